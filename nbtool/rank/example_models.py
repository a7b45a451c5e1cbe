"""Small models and data for tutorials, tests and benchmarks (CPU-friendly sizes).

``TinyTransformer`` has the parts strategies care about (embedding,
attention, MLP, layernorm, a ModuleList of blocks) at a size that trains in
seconds on CPU ranks. ``SyntheticTokens`` is learnable, deterministic data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        # head width from the projection's own output, so a tensor-parallel rank
        # (q/k/v column-sharded, self.heads = local heads) runs the same code
        q, k, v = (proj(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style decoder: token + position embedding, ``layers`` blocks, tied-free LM head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        # parts set to None are skipped, so one pipeline stage can run its share of the
        # model (the torchtitan convention nbtool's pp strategy relies on)
        x = ids
        if self.embed is not None:
            x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits, targets):
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class SyntheticTokens(Dataset):
    """(input, target) token sequences with a learnable rule: next = (a * cur + b) mod vocab.

    Each sample draws its own start token and (a, b) from a seeded generator,
    so every process builds the same data.
    """

    def __init__(self, samples: int = 256, seq: int = 16, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (samples,), generator=g)
        a = torch.randint(1, 4, (samples,), generator=g)
        b = torch.randint(0, vocab, (samples,), generator=g)
        toks = [start]
        for _ in range(seq):
            toks.append((a * toks[-1] + b) % vocab)
        self.tokens = torch.stack(toks, dim=1)  # samples x (seq + 1)

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        row = self.tokens[i]
        return row[:-1], row[1:]
