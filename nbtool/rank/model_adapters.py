"""What nbtool knows about the shape of a model, in one place (engine side).

tp, pp, fsdp wrapping, activation checkpointing and checkpoints all ask here:
which class the repeated blocks are and where their ModuleList sits, which
modules are norms, and how one pipeline stage of a decoder runs.

Three decoder shapes are known for pipeline stages:

- ``toplevel``: the blocks are a top-level ModuleList and the model's own
  forward skips parts that are None (nbtool's TinyTransformer): parts of other
  stages are set to None and the model's forward runs as written;
- ``llama``: Hugging Face Llama, Qwen2, Mistral and their kin
  (``model.embed_tokens``, ``model.rotary_emb``, ``model.layers``,
  ``model.norm``, ``lm_head``), masks built by the model's own module;
- ``gpt``: GPT-2 names (``transformer.wte``, ``wpe``, ``h``, ``ln_f`` and
  ``lm_head``): Hugging Face GPT-2 and nanoGPT-style code.

For the last two nbtool runs the stage itself (embeddings on the first,
blocks, final norm and head on the last), so before a model is cut
``check_stages`` runs the model's own forward and nbtool's stages on one
probe batch and refuses if their logits differ: a model whose forward does
more than these parts (scaled embeddings, extra layers) is refused, never
trained differently.
"""
from __future__ import annotations

import inspect
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .strategies.base import StrategyError


def repeated_block_class(model: nn.Module) -> str | None:
    """The class name of the repeated blocks (most common class in any ModuleList)."""
    counts: Counter = Counter()
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            counts.update(type(c).__name__ for c in m)
    return counts.most_common(1)[0][0] if counts else None


def block_classes(model: nn.Module) -> set[str]:
    """The block classes to shard (fsdp) or checkpoint one by one: a Hugging Face model's
    ``_no_split_modules`` present in it, else the class its ModuleLists repeat."""
    present = {type(m).__name__ for m in model.modules()}
    hf = set(getattr(model, "_no_split_modules", None) or ()) & present
    return hf or ({repeated_block_class(model)} - {None})


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The qualified name and the ModuleList of the model's repeated blocks."""
    cls = repeated_block_class(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(type(c).__name__ == cls for c in m):
            return name, m
    raise StrategyError("the model has no nn.ModuleList of repeated blocks; tensor and pipeline "
                        "parallelism need one (e.g. self.blocks = nn.ModuleList(Block(...) for ...)), "
                        "or pass plan={...} to strategy.prepare")


def is_norm(m: nn.Module) -> bool:
    """A module that normalises over the last dimension: a 1-D weight of size ``n``, output unchanged
    when the input is scaled (LayerNorm and RMSNorm both are); by name ``*Norm*`` when it cannot run."""
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or isinstance(m, (nn.Linear, nn.Embedding)):
        return False
    try:
        x = torch.randn(2, 3, w.shape[0], generator=torch.Generator().manual_seed(0), dtype=w.dtype)
        with torch.no_grad():
            y1, y2 = m(x), m(3.0 * x)
        return isinstance(y1, torch.Tensor) and y1.shape == x.shape and torch.allclose(y1, y2, atol=1e-4, rtol=1e-3)
    except Exception:
        return "Norm" in type(m).__name__ or "norm" in type(m).__name__


# -- pipeline stages -------------------------------------------------------------------------------
SUPPORTED_STAGES = (
    "nbtool cuts three shapes into stages: blocks in a top-level ModuleList with a forward that skips "
    "parts set to None; Hugging Face Llama-style decoders (model.embed_tokens, model.layers, model.norm, "
    "lm_head: Llama, Qwen2, Mistral); GPT-2 names (transformer.wte, wpe, h, ln_f and lm_head: GPT-2, "
    "nanoGPT). To split another model by hand, give it the first shape: its blocks in a top-level "
    "nn.ModuleList (self.blocks = nn.ModuleList(...)) and a forward that skips the parts nbtool sets to None "
    "on the stages that do not hold them (if self.embed is not None: x = self.embed(x); ...), as "
    "nbtool.rank.example_models.TinyTransformer does")


@dataclass
class Decoder:
    """Where a decoder's parts are: ``kind`` (toplevel, llama, gpt), the module owning the blocks
    (``trunk``, its qualified name ``trunk_name``), the blocks' attribute on it, the parts run
    before the blocks (first stage) and after them (last stage) as (owner, attribute) pairs."""
    kind: str
    trunk_name: str
    trunk: nn.Module
    blocks_attr: str
    before: tuple
    after: tuple
    head_owner: nn.Module | None = None

    @property
    def blocks(self) -> nn.ModuleList:
        return getattr(self.trunk, self.blocks_attr)

    def qualified(self, owner: nn.Module, attr: str) -> str:
        prefix = self.trunk_name if owner is self.trunk else self.trunk_name.rpartition(".")[0]  # the head's owner
        return f"{prefix}.{attr}" if prefix else attr


def decoder(model: nn.Module) -> Decoder:
    """The decoder shape of ``model`` for pipeline stages, or a StrategyError naming what is supported."""
    prefix, _ = block_list(model)
    trunk_name, _, attr = prefix.rpartition(".")
    if not trunk_name:
        names = [n for n, _ in model.named_children()]
        at = names.index(attr)
        return Decoder("toplevel", "", model, attr, tuple((model, n) for n in names[:at]),
                       tuple((model, n) for n in names[at + 1:]))
    modules = dict(model.named_modules())
    parent_name = trunk_name.rpartition(".")[0]
    trunk, parent = modules[trunk_name], modules[parent_name]
    kids = dict(trunk.named_children())
    if getattr(parent, "lm_head", None) is None:
        raise StrategyError(f"the blocks ({prefix}) are nested and {parent_name or 'the model'} has no lm_head "
                            f"next to {trunk_name}. {SUPPORTED_STAGES}")
    if attr == "layers" and {"embed_tokens", "norm"} <= set(kids):
        return Decoder("llama", trunk_name, trunk, attr, ((trunk, "embed_tokens"),),
                       ((trunk, "norm"), (parent, "lm_head")), parent)
    if attr == "h" and {"wte", "wpe", "ln_f"} <= set(kids):
        before = ((trunk, "wte"), (trunk, "wpe")) + (((trunk, "drop"),) if "drop" in kids else ())
        return Decoder("gpt", trunk_name, trunk, attr, before, ((trunk, "ln_f"), (parent, "lm_head")), parent)
    raise StrategyError(f"nbtool does not know how to run a pipeline stage of {type(model).__name__} "
                        f"(blocks at {prefix}, next to {', '.join(sorted(kids))}). {SUPPORTED_STAGES}")


class KeptBlocks(nn.ModuleList):
    """A ModuleList holding some of the blocks under their global indices ("2", "3" ...).

    Iteration yields the kept blocks in order, and their parameter names
    (``blocks.2.attn...``) stay those of the whole model.
    """

    def __init__(self, kept: dict):
        super().__init__()
        self._modules.update(kept)

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # Hugging Face slices its layers: a plain list of the kept ones
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


class StageModule(nn.Module):
    """One pipeline stage of a ``llama`` or ``gpt`` decoder: runs the first stage's embeddings, this
    stage's blocks, and the last stage's final norm and head; the input is token ids on the first
    stage and the previous stage's hidden states elsewhere; the last stage returns logits.

    It holds the whole (cut) model as its one child, so parameter names are the model's,
    prefixed ``model.``.
    """

    def __init__(self, model: nn.Module, shape: Decoder, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last
        self._shape = shape

    def forward(self, x):
        d = self._shape
        h = _embed(d, x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if d.kind == "llama":
            masks = _llama_masks(d.trunk, h, positions)
            rotary = d.trunk.rotary_emb(h, positions)
            types = getattr(d.trunk.config, "layer_types", None)
            for key, block in d.blocks._modules.items():
                kind = types[int(key)] if types else "full_attention"
                h = _hidden(block(h, attention_mask=masks.get(kind, masks["full_attention"]),
                                  position_embeddings=rotary, position_ids=positions))
        else:
            mask = _gpt_mask(d.trunk, h, positions)
            for block in d.blocks:
                h = _hidden(block(h, attention_mask=mask) if mask is not _NO_MASK else block(h))
        if self.last:
            norm, head = (getattr(owner, attr) for owner, attr in d.after)
            h = head(norm(h))
        return h


_NO_MASK = object()


def _embed(d: Decoder, ids):
    if d.kind == "llama":
        return d.trunk.embed_tokens(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    h = d.trunk.wte(ids) + d.trunk.wpe(positions)
    drop = getattr(d.trunk, "drop", None)
    return drop(h) if drop is not None else h


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _make_mask(fn, config, h, positions):
    """``fn(...)``, one of transformers' mask functions, with the keyword arguments its signature takes."""
    # the cache argument was renamed (past_key_values -> cache) across transformers versions
    params = inspect.signature(fn).parameters
    kw = {"config": config, "inputs_embeds": h, "attention_mask": None, "position_ids": positions}
    kw.update({k: None for k in ("cache", "past_key_values", "cache_position") if k in params})
    return fn(**{k: v for k, v in kw.items() if k in params})


def _llama_masks(trunk, h, positions) -> dict:
    """{layer type: mask} as the model's own module builds them (Qwen2 names a type per layer;
    Mistral slides every layer when its config has a window)."""
    module = sys.modules[type(trunk).__module__]
    config = trunk.config
    types = getattr(config, "layer_types", None)
    sliding = "sliding_attention" in (types or ()) or (types is None and getattr(config, "sliding_window", None))
    masks = {"full_attention": _make_mask(module.create_causal_mask, config, h, positions)}
    if sliding:
        masks["sliding_attention"] = _make_mask(module.create_sliding_window_causal_mask, config, h, positions)
        if types is None:
            masks["full_attention"] = masks["sliding_attention"]
    return masks


def _gpt_mask(trunk, h, positions):
    fn = getattr(sys.modules[type(trunk).__module__], "create_causal_mask", None)
    if fn is None or getattr(trunk, "config", None) is None:  # nanoGPT-style: its blocks mask themselves
        return _NO_MASK
    return _make_mask(fn, trunk.config, h, positions)


def _own_logits(model: nn.Module, head: nn.Module, ids) -> torch.Tensor | None:
    """The head's output when the model's own forward runs on ``ids`` (tried as model(ids),
    model(input_ids=ids), model(ids, ids), model(input_ids=ids, labels=ids)), or None."""
    seen = []
    handle = head.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        for call in (lambda: model(ids), lambda: model(input_ids=ids), lambda: model(ids, ids),
                     lambda: model(input_ids=ids, labels=ids)):
            seen.clear()
            try:
                call()
            except Exception:
                continue
            if seen:
                return seen[-1]
    finally:
        handle.remove()
    return None


@torch.no_grad()
def check_stages(model: nn.Module, shape: Decoder) -> None:
    """Refuse unless nbtool's stages, run one after another, give the logits of the model's own forward."""
    if shape.kind == "toplevel":
        return  # the model's own forward runs on every stage
    head = getattr(shape.head_owner, "lm_head")
    vocab = getattr(head, "out_features", None) or 2
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()  # dropout off: both runs must be deterministic
    try:
        ref = _own_logits(model, head, ids)
        ours = StageModule(model, shape, first=True, last=True)(ids)
    finally:
        model.train(was_training)
    if ref is None:
        raise StrategyError(f"nbtool could not run {type(model).__name__}'s own forward on token ids to check its "
                            f"pipeline stages against it (tried model(ids), model(input_ids=ids) and with labels). "
                            f"{SUPPORTED_STAGES}")
    if ref.shape != ours.shape:
        ours = ours[:, -ref.shape[1]:] if ref.dim() == 3 and ref.shape[1] < ours.shape[1] else ours
    if ref.shape != ours.shape or not torch.allclose(ref, ours, atol=1e-5, rtol=1e-4):
        diff = (ref - ours).abs().max().item() if ref.shape == ours.shape else f"shape {tuple(ref.shape)}"
        raise StrategyError(
            f"{type(model).__name__}'s own forward does more than nbtool's {shape.kind} stages run (embeddings, "
            f"blocks, {shape.qualified(*shape.after[0])}, lm_head): their logits differ ({diff}), so splitting it "
            f"would train a different model. {SUPPORTED_STAGES}")
