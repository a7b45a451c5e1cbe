"""Tensor-parallel plans: which submodule gets which DTensor placement (engine side).

A plan maps module names (fnmatch patterns allowed, as in
``parallelize_module``) to ParallelStyles. ``default_plan`` writes one for
the common transformer block shape, Megatron's layout:

- attention: q/k/v projections column-parallel (each rank owns heads/tp
  heads), the output projection row-parallel (its all-reduce, or
  reduce-scatter with --sp, ends the region);
- a fused q/k/v projection (nanoGPT's and GPT-2's ``c_attn``) is split so
  each rank gets its heads' q, k and v (nbtool.rank.tp_styles), but only after
  ``probe_fused`` ran a sharded copy of the part and got the whole part's
  output; a forward that reshapes by the full width (nanoGPT's ``C`` from
  ``x.size()``) fails that probe and the part stays replicated;
- transformers' ``Conv1D`` (GPT-2) is sharded like nn.Linear, on its
  transposed weight;
- MLP: up (and gate) column-parallel, down row-parallel;
- each attention and MLP module gets its input as one replicated DTensor
  (``BlockInput``: its first positional argument, or a keyword argument such
  as Hugging Face's ``hidden_states=``), so q, k and v share it and backward
  all-reduces the input gradient once, as Megatron's ``f``: 2 all-reduces
  forward and 2 backward per block;
- with ``sp`` the blocks' layer norms run on sequence shards
  (SequenceParallel), the all-reduces become all-gather + reduce-scatter
  pairs, and the first block's input is split (the last block's output
  gathered) so embeddings and head stay as written; under a pipeline each
  stage's, so what crosses from one stage to the next is whole (a rank with
  two stages had split the second's input again: a size mismatch).

Everything else (embeddings, final norm, head) stays replicated.

Norms are recognised by behaviour (a module with a 1-D weight of the block's
width whose output does not change when its input is scaled: LayerNorm,
RMSNorm, or a model's own class such as nanoGPT's), not by a list of classes.
Before anything is sharded, ``coverage`` checks the plan against every block:
parts holding linear weights the plan leaves replicated, and, with ``sp``,
norms left out, are refused (with sp: a split sequence through a replicated
part trains wrong) or reported (without: the part is merely not sharded).
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from . import tp_styles
from .model_adapters import block_list, is_norm
from .strategies.base import StrategyError

ATTENTION_IN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value")
ATTENTION_OUT = ("o_proj", "wo", "out_proj", "c_proj", "dense", "proj")
MLP_IN = ("up", "up_proj", "gate_proj", "fc1", "w1", "w3", "c_fc", "fc_in", "dense_h_to_4h")
MLP_OUT = ("down", "down_proj", "fc2", "w2", "c_proj", "fc_out", "dense_4h_to_h")
ATTENTION_FUSED = ("c_attn", "qkv_proj", "qkv", "query_key_value", "Wqkv", "W_pack")
WIDTH_ATTRS = ("split_size", "embed_dim", "n_embd")
HEAD_ATTRS = ("heads", "num_heads", "n_heads", "n_head", "num_attention_heads",
              "num_key_value_heads", "n_kv_heads")
WHAT_IS_SPLIT = (
    "nbtool splits projections named like q_proj/k_proj/v_proj/o_proj and gate_proj/up_proj/down_proj "
    "(nn.Linear or transformers' Conv1D), and a fused c_attn/qkv_proj/query_key_value when a sharded copy "
    "of its part computes what the whole part does; a forward that reshapes by the full width (such as "
    "nanoGPT's C from x.size()) does not, so that part stays whole.")


def default_plan(model: nn.Module, sp: bool, mesh=None, stages: list | None = None) -> dict:
    """Megatron's layout for every block of ``model`` (see the module docstring).

    A fused q/k/v projection is split only as ``probe_fused`` finds its part
    computes the same sharded as whole (that needs the tensor-parallel
    ``mesh``); otherwise the part stays replicated and ``coverage`` says so.
    ``stages``: the block keys of each pipeline stage this rank runs (None: one, every block).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    BlockInput = tp_styles.block_input_style()

    prefix, blocks = block_list(model)
    region = Shard(1) if sp else Replicate()  # layout between the tensor-parallel regions
    plan = {}
    probed: dict = {}  # (part class, name) -> style maker for its fused projection, or None
    for key, block in blocks.named_children():
        base = f"{prefix}.{key}"
        parts = 0  # children with projections nbtool knows (split or, if a fused probe failed, not)
        for sub_name, sub in block.named_children():
            if is_norm(sub):
                if sp:
                    plan[f"{base}.{sub_name}"] = SequenceParallel()
                continue
            ins, outs, fused = part_projections(sub)
            if not ins or len(outs) != 1:
                continue
            parts += 1
            styles = [tp_styles.colwise() for _ in ins]
            if fused:
                cache = (type(sub).__name__, sub_name)
                if cache not in probed:
                    probed[cache] = probe_fused(sub, ins[0], outs[0], mesh) if mesh is not None else None
                if probed[cache] is None:
                    continue  # left replicated: coverage() reports it
                styles = [probed[cache]()]
            plan[f"{base}.{sub_name}"] = BlockInput(region)
            for n, style in zip(ins, styles):
                plan[f"{base}.{sub_name}.{n}"] = style
            plan[f"{base}.{sub_name}.{outs[0]}"] = tp_styles.rowwise(output_layouts=region)
        if not parts:
            raise StrategyError(
                f"no default tensor-parallel plan for {base} ({type(block).__name__}): nbtool looks for "
                f"children with column-parallel linears ({', '.join(ATTENTION_IN[:3])} ... or "
                f"{', '.join(MLP_IN[:3])} ..., or a fused {', '.join(ATTENTION_FUSED[:3])} ...) and one "
                f"row-parallel linear ({', '.join(ATTENTION_OUT[:3])} ... or {', '.join(MLP_OUT[:3])} ...); "
                "pass plan={'blocks.*.attn.q_proj': ColwiseParallel(), ...} to strategy.prepare"
            )
    # split each stage's first block's input along the sequence, gather its last one's output
    for keys in (stages or [[k for k, _ in blocks.named_children()]]) if sp and len(blocks) else ():
        first, last = f"{prefix}.{keys[0]}", f"{prefix}.{keys[-1]}"
        split, gather = BlockInput(Replicate(), Shard(1), local=True), tp_styles.block_output_style()()
        plan.update({first: _both(split, gather)} if first == last else {first: split, last: gather})
    return plan


def _both(*styles):
    """One ParallelStyle applying several to the same module (the only block under --sp)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class Both(ParallelStyle):
        def _apply(self, module, mesh):
            for style in styles:
                style._apply(module, mesh)
            return module

    return Both()


def part_projections(part: nn.Module) -> tuple[list[str], list[str], bool]:
    """(column-parallel projections, row-parallel ones, whether the first is a fused q/k/v) of a block part."""
    linears = {n for n, c in part.named_children() if tp_styles.linear_like(c)}
    separate = [n for n in ATTENTION_IN if n in linears]
    fused = [n for n in ATTENTION_FUSED if n in linears] if not separate else []
    if separate or fused:
        return separate or fused[:1], [n for n in ATTENTION_OUT if n in linears], bool(fused)
    return [n for n in MLP_IN if n in linears], [n for n in MLP_OUT if n in linears], False


def _first_tensor(out):
    from torch.distributed.tensor import DTensor

    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.full_tensor() if isinstance(out, DTensor) else out


def probe_fused(part: nn.Module, qkv_name: str, out_name: str, mesh):
    """A maker of the style that splits ``part``'s fused projection, or None when no split computes
    what the whole part does on a probe input.

    Tried in order: [q | k | v] segments (nanoGPT, GPT-2; with grouped-query
    heads from the part's head counts), then heads interleaved (GPT-NeoX's
    query_key_value: a plain column split keeps whole heads). Each try shards a
    copy of the part (with head counts and widths divided by tp) and compares
    its output with the whole part's; every tp rank runs the same tries.
    """
    import copy

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    qkv = getattr(part, qkv_name)
    width, n = tp_styles.in_features(qkv), tp_styles.out_features(qkv)
    heads = next((getattr(part, a) for a in ("num_heads", "n_head", "num_attention_heads", "n_heads")
                  if isinstance(getattr(part, a, None), int)), None)
    kv = getattr(part, "num_key_value_heads", None)
    head_dim = getattr(part, "head_dim", None) or (width // heads if heads else None)
    segments = ((heads * head_dim, kv * head_dim, kv * head_dim) if isinstance(kv, int) and heads and head_dim
                else (n // 3,) * 3)
    makers = []
    if sum(segments) == n and all(s % tp == 0 for s in segments):
        makers.append(lambda: tp_styles.fused_colwise(qkv, segments, tp))
    if n % tp == 0:
        makers.append(tp_styles.colwise)
    weight = qkv.weight
    x = torch.randn(2, 4, width, generator=torch.Generator().manual_seed(0), dtype=weight.dtype).to(weight.device)
    was_training = part.training
    try:
        with torch.no_grad():
            ref = _first_tensor(part.eval()(x))
    except Exception:
        return None  # it cannot run alone on (batch, seq, width): not split
    finally:
        part.train(was_training)
    for make in makers:
        trial = copy.deepcopy(part).eval()
        localize_part(trial, tp, width)
        parallelize_module(trial, mesh, tp_styles.block_input_style()(Replicate()))
        parallelize_module(trial, mesh, {qkv_name: make(), out_name: tp_styles.rowwise()})
        try:
            with torch.no_grad():
                ok = torch.allclose(_first_tensor(trial(x)), ref, atol=1e-5, rtol=1e-4)
        except Exception:
            ok = False
        if ok:
            return make
    return None


def localize_part(part: nn.Module, tp: int, width: int | None = None) -> list[str]:
    """Divide a sharded attention part's head counts (and, for a fused projection, the widths it
    splits by, such as GPT-2's split_size or nanoGPT's n_embd) by tp; what changed."""
    changed = []
    for attr in HEAD_ATTRS + (WIDTH_ATTRS if width else ()):
        value = getattr(part, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and (attr in HEAD_ATTRS or value == width):
            setattr(part, attr, value // tp)
            changed.append(f"{attr} {value} -> {value // tp} per rank")
    return changed


def matching(plan: dict, model: nn.Module) -> dict:
    """{pattern: [module names it matches]} for each plan entry (exact names looked up directly)."""
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    return {pattern: ([n for n in names if fnmatch.fnmatchcase(n, pattern)] if _WILDCARDS & set(pattern)
                      else [pattern] if pattern in known else [])
            for pattern in plan}


_WILDCARDS = set("*?[")


def check_plan(plan: dict, model: nn.Module, tp: int) -> None:
    """Refuse a plan naming modules the model lacks, or sizes tp does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    matches = matching(plan, model)
    for pattern, names in matches.items():
        if not names:
            near = sorted(n for n in modules if n.split(".")[-1] == pattern.split(".")[-1])[:3]
            hint = f" (modules with that last name: {', '.join(near)})" if near else ""
            raise StrategyError(f"plan entry {pattern!r} names no module of the model{hint}")
        style = plan[pattern]
        for name in (names if isinstance(style, (ColwiseParallel, RowwiseParallel)) else ()):
            size = _split_size(modules[name], style)
            if size is not None and size % tp:
                dim = "output" if isinstance(style, ColwiseParallel) else "input"
                raise StrategyError(f"{name}: {dim} size {size} is not divisible by tp({tp}); "
                                    f"use a tp that divides {size}")
    attention = parallel_attention(plan, matches)
    for name in (n for n in modules if n in attention):
        head_dim = getattr(modules[name], "head_dim", None)  # Hugging Face attention: heads from the widths
        if isinstance(head_dim, int) and head_dim > 0:
            for proj in ATTENTION_IN:
                lin = modules.get(f"{name}.{proj}")
                if isinstance(lin, nn.Linear) and (lin.out_features // head_dim) % tp:
                    heads = lin.out_features // head_dim
                    kind = "key/value" if proj in ("k_proj", "v_proj", "wk", "wv", "key", "value") else "query"
                    raise StrategyError(f"{name}.{proj} holds {heads} {kind} head(s) of {head_dim}; tp({tp}) would "
                                        f"split a head (grouped-query attention needs kv heads divisible by tp): "
                                        f"use a tp that divides {heads}")
        for attr in HEAD_ATTRS:
            heads = getattr(modules[name], attr, None)
            if isinstance(heads, int) and heads % tp:
                raise StrategyError(f"{name}.{attr} = {heads} heads are not divisible by tp({tp}); "
                                    f"each rank must own whole heads: use a tp that divides {heads}")


def localize_heads(plan: dict, model: nn.Module, tp: int) -> list[str]:
    """Divide head counts of the column-sharded attention modules by tp (each rank runs heads/tp),
    and the widths a fused q/k/v projection is split by."""
    attention = parallel_attention(plan, matching(plan, model))
    modules = dict(model.named_modules())
    changed = []
    for name, m in model.named_modules():  # in model order, for describe()
        if name not in attention:
            continue
        fused = next((modules[f"{name}.{f}"] for f in ATTENTION_FUSED if f"{name}.{f}" in modules), None)
        width = tp_styles.in_features(fused) if fused is not None and attention[name] else None
        changed += [f"{name}.{c}" for c in localize_part(m, tp, width)]
    return changed


def parallel_attention(plan: dict, matches: dict) -> dict[str, bool]:
    """{module: whether its projection is fused} for modules whose q/k/v projections the plan makes
    column-parallel (their heads get split)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    out = {}
    for (pattern, names), style in zip(matches.items(), plan.values()):
        if isinstance(style, ColwiseParallel):
            for n in names:
                parent, _, child = n.rpartition(".")
                if child in ATTENTION_IN or child in ATTENTION_FUSED:
                    out[parent] = child in ATTENTION_FUSED
    return out


def permuted_params(plan: dict, model: nn.Module) -> dict:
    """{parameter name: (QKVPermutation, dim)} for the parameters a fused_colwise style sharded."""
    modules = dict(model.named_modules())
    out = {}
    for (pattern, names), style in zip(matching(plan, model).items(), plan.values()):
        permutation = getattr(style, "permutation", None)
        if permutation is None:
            continue
        for name in names:
            out[f"{name}.weight"] = (permutation, permutation.dim)
            if getattr(modules[name], "bias", None) is not None:
                out[f"{name}.bias"] = (permutation, 0)
    return out


def _split_size(m: nn.Module, style) -> int | None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = isinstance(style, ColwiseParallel)
    if tp_styles.linear_like(m):
        return tp_styles.out_features(m) if colwise else tp_styles.in_features(m)
    if isinstance(m, nn.Embedding):
        return m.embedding_dim if colwise else m.num_embeddings
    return None



def coverage(plan: dict, model: nn.Module, sp: bool) -> tuple[list[str], list[str]]:
    """(block parts with linear weights the plan leaves whole, norms left out of SequenceParallel with sp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    prefix, blocks = block_list(model)
    styled = {n: plan[p] for p, names in matching(plan, model).items() for n in names}
    replicated, norms = [], []
    for key, block in blocks.named_children():
        for name, m in block.named_modules(prefix=f"{prefix}.{key}"):
            has_weight = isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
            if has_weight and not isinstance(m, nn.Embedding) and not isinstance(
                    styled.get(name), (ColwiseParallel, RowwiseParallel)):
                replicated.append(f"{name} ({type(m).__name__})")
            elif sp and is_norm(m) and not isinstance(styled.get(name), SequenceParallel):
                norms.append(f"{name} ({type(m).__name__})")
    return replicated, norms
