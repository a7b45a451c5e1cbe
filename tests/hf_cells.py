"""Cells that build models nbtool did not write in the ranks, from configs (no hub): Hugging Face Llama,
Qwen2, Mistral (GQA) and GPT-2 (``SETUP``), and a nanoGPT-style model (``NANOGPT``: fused QKV, its own
LayerNorm), with the training helpers the tests run under each strategy. Shared by the test modules
that run them on 2 ranks (test_hf_models) and on 4 (test_parallel_4ranks)."""

SETUP = """%%distributed --quiet
import transformers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

CONFIGS = {
    "llama": lambda layers=2: LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                  max_position_embeddings=64)),
    "qwen2": lambda layers=2: Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                  max_position_embeddings=64)),
    "mistral": lambda layers=2: MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                        max_position_embeddings=64, sliding_window=8)),
    # no dropout, so every strategy draws the same (no) random numbers
    "gpt2": lambda layers=2: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}
_ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))

def _hf_train(strategy, family, seed=0, steps=2):
    torch.manual_seed(seed)
    model = CONFIGS[family]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer)
    for step in range(steps):
        x = _ids[rank * 4:(rank + 1) * 4]
        loss = model(input_ids=x, labels=x).loss
        strategy.backward(loss)
        optimizer.step(); optimizer.zero_grad()
    return strategy.full_state_dict()

def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k].float(), b[k].float()) for k in a)
"""

NANOGPT = """%%distributed --quiet
import torch.nn.functional as F
from torch import nn

class LayerNorm(nn.Module):  # nanoGPT's own: neither nn.LayerNorm nor an RMSNorm
    def __init__(self, ndim):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(ndim)), nn.Parameter(torch.zeros(ndim))
    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head, self.n_embd = nn.Linear(d, 3 * d), nn.Linear(d, d), h, d
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(d), CausalSelfAttention(d, h), LayerNorm(d), MLP(d)
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, vocab=128, d=64, h=4, layers=2, block=64):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                                              h=nn.ModuleList(Block(d, h) for _ in range(layers)), ln_f=LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for b in self.transformer.h:
            x = b(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else _lm_loss(logits, targets)
        return logits, loss

CONFIGS["nanogpt"] = lambda layers=2: GPT(layers=layers)

def _lm_loss(out, y):  # next-token loss of HF's .logits, nanoGPT's (logits, loss), or a last stage's logits
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1))

def _losses(strategy, family, steps=3, seed=0, layers=2):  # fp32 losses of SGD steps on one global batch of 8
    torch.manual_seed(seed)
    model = CONFIGS[family](layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer, loss_fn=_lm_loss)
    per = 8 // strategy.dp_size
    out = []
    for step in range(steps):
        x = _ids[strategy.dp_rank * per:(strategy.dp_rank + 1) * per]
        loss = strategy.forward_backward(x, x)
        optimizer.step(); optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append(mean.item() / world_size)
    return out

def _state_after(strategy, family, seed=0, steps=2):  # the full state dict after a few steps (rank 0)
    _losses(strategy, family, steps, seed)
    return strategy.full_state_dict()
"""



# a cell body that loads the checkpoint at {path!r} into {family!r} under the cell's strategy and compares it
# with ``_saved`` (rank 0): ``_ok`` identical, ``_tied`` GPT-2's head still its embedding, ``_note`` what loaded
_LOAD_AND_COMPARE = (
    "_losses(strategy, {family!r}, steps=0, seed=1)\n_note = strategy.load({path!r})['restored']\n"
    "_loaded = strategy.full_state_dict()\n"
    "_ok = _same(_saved, _loaded) if rank == 0 else None\n"
    "_tied = None\n"
    "if rank == 0:\n"
    "    _pair = [k for k in _loaded if k.endswith('lm_head.weight') or k.endswith('wte.weight')]\n"
    "    _tied = len(_pair) == 2 and torch.equal(*(_loaded[k] for k in _pair))")


def move_checkpoint(ip, family: str, first: str, second: str, path: str) -> tuple:
    """Train ``family`` under the line ``first`` and save to ``path``; load it under ``second``. Rank 0's
    (identical weights, tied weights still tied, what loaded: strategy.load's "restored")."""
    ip.run_cell(f"%%distributed {first} --quiet --no-metrics\n"
                f"_saved = _state_after(strategy, {family!r})\nstrategy.save({path!r})").raise_error()
    ip.run_cell(f"%%distributed {second} --quiet --no-metrics\n"
                + _LOAD_AND_COMPARE.format(family=family, path=path)).raise_error()
    ip.run_line_magic("dist_pull", "_ok _tied _note --rank 0")
    return ip.user_ns["_ok"], ip.user_ns["_tied"], ip.user_ns["_note"]
