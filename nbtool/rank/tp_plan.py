"""Tensor-parallel plans: which submodule gets which DTensor placement (engine side).

A plan maps module names (fnmatch patterns allowed, as in
``parallelize_module``) to ParallelStyles. ``default_plan`` writes one for
the common transformer block shape, Megatron's layout:

- attention: q/k/v projections column-parallel (each rank owns heads/tp
  heads), the output projection row-parallel (its all-reduce, or
  reduce-scatter with --sp, ends the region);
- MLP: up (and gate) column-parallel, down row-parallel;
- each attention and MLP module gets its input as one replicated DTensor
  (``BlockInput``: its first positional argument, or a keyword argument such
  as Hugging Face's ``hidden_states=``), so q, k and v share it and backward
  all-reduces the input gradient once, as Megatron's ``f``: 2 all-reduces
  forward and 2 backward per block;
- with ``sp`` the blocks' layer norms run on sequence shards
  (SequenceParallel), the all-reduces become all-gather + reduce-scatter
  pairs, and the first block's input is split (the last block's output
  gathered) so embeddings and head stay as written.

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

from .strategies.base import StrategyError, repeated_block_class

ATTENTION_IN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value")
ATTENTION_OUT = ("o_proj", "wo", "out_proj", "c_proj", "dense", "proj")
MLP_IN = ("up", "up_proj", "gate_proj", "fc1", "w1", "w3", "c_fc", "fc_in", "dense_h_to_4h")
MLP_OUT = ("down", "down_proj", "fc2", "w2", "c_proj", "fc_out", "dense_4h_to_h")
HEAD_ATTRS = ("heads", "num_heads", "n_heads", "n_head", "num_attention_heads",
              "num_key_value_heads", "n_kv_heads")


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The qualified name and the ModuleList of the model's repeated blocks."""
    cls = repeated_block_class(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(type(c).__name__ == cls for c in m):
            return name, m
    raise StrategyError("the model has no nn.ModuleList of repeated blocks; tensor and pipeline "
                        "parallelism need one (e.g. self.blocks = nn.ModuleList(Block(...) for ...)), "
                        "or pass plan={...} to strategy.prepare")


def default_plan(model: nn.Module, sp: bool) -> dict:
    """Megatron's layout for every block of ``model`` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleInputOutput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    BlockInput = block_input_style()

    prefix, blocks = block_list(model)
    region = Shard(1) if sp else Replicate()  # layout between the tensor-parallel regions
    plan = {}
    for key, block in blocks.named_children():
        base = f"{prefix}.{key}"
        found = []
        for sub_name, sub in block.named_children():
            linears = {n for n, c in sub.named_children() if isinstance(c, nn.Linear)}
            ins = [n for n in (ATTENTION_IN if linears & set(ATTENTION_IN) else MLP_IN) if n in linears]
            outs = [n for n in (ATTENTION_OUT if linears & set(ATTENTION_IN) else MLP_OUT) if n in linears]
            if is_norm(sub):
                if sp:
                    plan[f"{base}.{sub_name}"] = SequenceParallel()
                continue
            if not ins or len(outs) != 1:
                continue
            plan[f"{base}.{sub_name}"] = BlockInput(region)
            for n in ins:
                plan[f"{base}.{sub_name}.{n}"] = ColwiseParallel()
            plan[f"{base}.{sub_name}.{outs[0]}"] = RowwiseParallel(output_layouts=region)
            found.append(sub_name)
        if not found:
            raise StrategyError(
                f"no default tensor-parallel plan for {base} ({type(block).__name__}): nbtool looks for "
                f"children with column-parallel linears ({', '.join(ATTENTION_IN[:3])} ... or "
                f"{', '.join(MLP_IN[:3])} ...) and one row-parallel linear "
                f"({', '.join(ATTENTION_OUT[:3])} ... or {', '.join(MLP_OUT[:3])} ...); "
                "pass plan={'blocks.*.attn.q_proj': ColwiseParallel(), ...} to strategy.prepare"
            )
    if sp and len(blocks):
        keys = [k for k, _ in blocks.named_children()]
        split = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        gather = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
        first, last = f"{prefix}.{keys[0]}", f"{prefix}.{keys[-1]}"
        if first == last:  # one block: split its input and gather its output
            plan[first] = PrepareModuleInputOutput(**split, use_local_input=True, **gather)
        else:
            plan[first] = PrepareModuleInput(**split, use_local_output=True)
            plan[last] = PrepareModuleOutput(**gather)
    return plan


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
        for name in names:
            m = modules[name]
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                size = _split_size(m, style)
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
    """Divide head counts of the column-sharded attention modules by tp (each rank runs heads/tp)."""
    attention = parallel_attention(plan, matching(plan, model))
    changed = []
    for name, m in model.named_modules():  # in model order, for describe()
        if name not in attention:
            continue
        for attr in HEAD_ATTRS:
            heads = getattr(m, attr, None)
            if isinstance(heads, int):
                setattr(m, attr, heads // tp)
                changed.append(f"{name}.{attr} {heads} -> {heads // tp} per rank")
    return changed


def parallel_attention(plan: dict, matches: dict) -> set[str]:
    """Modules whose q/k/v projections the plan makes column-parallel (their heads get split)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    out = set()
    for (pattern, names), style in zip(matches.items(), plan.values()):
        if isinstance(style, ColwiseParallel):
            for n in names:
                parent, _, child = n.rpartition(".")
                if child in ATTENTION_IN:
                    out.add(parent)
    return out


def _split_size(m: nn.Module, style) -> int | None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = isinstance(style, ColwiseParallel)
    if isinstance(m, nn.Linear):
        return m.out_features if colwise else m.in_features
    if isinstance(m, nn.Embedding):
        return m.embedding_dim if colwise else m.num_embeddings
    return None



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


def coverage(plan: dict, model: nn.Module, sp: bool) -> tuple[list[str], list[str]]:
    """(block parts with linear weights the plan leaves whole, norms left out of SequenceParallel with sp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    prefix, blocks = block_list(model)
    matched = matching(plan, model)
    styled = {n: plan[p] for p, names in matched.items() for n in names}
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


def block_input_style():
    """A ParallelStyle putting a block part's input into the tensor-parallel region as one DTensor.

    Like PrepareModuleInput, but it finds the input whether the part is called
    positionally (``self.attn(x)``) or by keyword (Hugging Face's
    ``self.self_attn(hidden_states=x, ...)``, where PrepareModuleInput's
    ``input_layouts`` fails with "module inputs and input_layouts should have
    same length!").
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class BlockInput(ParallelStyle):
        def __init__(self, layout):
            super().__init__()
            self.layout = layout
            self.input_layouts, self.desired_input_layouts = (layout,), (Replicate(),)  # for describe()

        def _apply(self, module, mesh):
            layout = self.layout

            def convert(x):
                if not isinstance(x, torch.Tensor):
                    return x
                if not isinstance(x, DTensor):  # a local tensor in the region's layout
                    x = DTensor.from_local(x, mesh, (layout,), run_check=False)
                # once here, so q, k and v (or gate and up) share one gather instead of one each
                return x if tuple(x.placements) == (Replicate(),) else x.redistribute(placements=(Replicate(),))

            def hook(_, args, kwargs):
                if args:
                    return (convert(args[0]), *args[1:]), kwargs
                key = next((k for k in ("hidden_states", "x", "input", "hidden") if k in kwargs), None)
                if key is None:
                    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
                if key is not None:
                    kwargs = {**kwargs, key: convert(kwargs[key])}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return BlockInput
