"""DTensor ParallelStyles torch does not ship, for the layers real models use (engine side).

- ``BlockInput`` / ``BlockOutput``: a block (part)'s hidden states moved
  between layouts, whether it is called positionally or by keyword (Hugging
  Face's ``self.self_attn(hidden_states=x, ...)``) and whether it returns a
  tensor or a tuple.
- ``colwise`` / ``rowwise``: torch's ColwiseParallel / RowwiseParallel, also
  for transformers' ``Conv1D`` (GPT-2), whose weight is stored transposed,
  (in, out): y = x W + b. Column-parallel shards W's dim 1 (and b), row-parallel
  its dim 0, so the state dict keeps Conv1D's layout and checkpoints load in
  any strategy.
- ``fused_colwise``: a fused q/k/v projection whose output is [q | k | v]
  (nanoGPT's and GPT-2's ``c_attn``). A plain column split would give rank 0
  all of q and part of k; instead the output rows are permuted so that rank r's
  contiguous shard is [q_r | k_r | v_r] (its heads' q, k and v). The sharded
  parameter is then the *permuted* matrix, so ``QKVPermutation`` undoes the
  permutation wherever the full weight is read or written (state dicts,
  checkpoints).
"""
from __future__ import annotations

import itertools

import torch
from torch import nn


def is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (a linear layer with its weight stored as (in, out))."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def out_features(m: nn.Module) -> int:
    return m.nf if is_conv1d(m) else m.out_features


def in_features(m: nn.Module) -> int:
    return m.weight.shape[0] if is_conv1d(m) else m.in_features


class QKVPermutation:
    """The row order of a fused projection's output under ``fused_colwise``: for each rank r, each
    segment's r-th slice. ``apply`` turns the model's layout into the sharded one, ``undo`` back."""

    def __init__(self, segments: tuple[int, ...], tp: int, dim: int):
        self.segments, self.tp, self.dim = tuple(segments), tp, dim
        starts = itertools.accumulate(segments, initial=0)
        spans = [(start, s // tp) for start, s in zip(starts, segments)]  # each segment's start, its slice per rank
        self.order = torch.tensor([start + r * per + i for r in range(tp) for start, per in spans for i in range(per)])
        self.inverse = torch.argsort(self.order)

    def apply(self, t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        return t.index_select(self.dim if dim is None else dim, self.order.to(t.device))

    def undo(self, t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        return t.index_select(self.dim if dim is None else dim, self.inverse.to(t.device))


def _distribute(module, mesh, placements: dict, src_data_rank, permutation: QKVPermutation | None = None):
    """Replace each named parameter of ``module`` by a DTensor parameter with its placement."""
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        data = param
        if permutation is not None:  # weight: along its output dim; bias: dim 0
            data = permutation.apply(param.detach(), dim=permutation.dim if name == "weight" else 0)
        dist_param = nn.Parameter(distribute_tensor(data, mesh, [placements[name]], src_data_rank=src_data_rank),
                                  requires_grad=param.requires_grad)
        module.register_parameter(name, dist_param)


def _apply_conv1d(style, m, mesh):
    """What torch's Colwise/RowwiseParallel._apply do for nn.Linear, for a Conv1D (torch refuses any
    class but nn.Linear and nn.Embedding); ``style._partition_linear_fn`` knows Conv1D's layout."""
    from functools import partial

    from torch.distributed.tensor import distribute_module

    return distribute_module(m, mesh, style._partition_linear_fn,
                             partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                             partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


def colwise(permutation: QKVPermutation | None = None, **kwargs):
    """ColwiseParallel that also shards Conv1D (and, with ``permutation``, a fused q/k/v projection)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class ColwiseParallel(ColwiseParallel):  # noqa: F811 (torch's name in describe())
        def _partition_linear_fn(self, name, m, mesh):
            out_dim = 1 if is_conv1d(m) else 0
            _distribute(m, mesh, {"weight": Shard(out_dim), "bias": Shard(0)}, self.src_data_rank, permutation)

        def _apply(self, m, mesh):
            return _apply_conv1d(self, m, mesh) if is_conv1d(m) else super()._apply(m, mesh)

    style = ColwiseParallel(**kwargs)
    style.permutation = permutation
    return style


def rowwise(**kwargs):
    """RowwiseParallel that also shards Conv1D (weight dim 0, the input's, bias replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    class RowwiseParallel(RowwiseParallel):  # noqa: F811
        def _partition_linear_fn(self, name, m, mesh):
            in_dim = 0 if is_conv1d(m) else 1
            _distribute(m, mesh, {"weight": Shard(in_dim), "bias": Replicate()}, self.src_data_rank)

        def _apply(self, m, mesh):
            if is_conv1d(m):
                self.desired_input_layouts = (Shard(-1),)  # as torch's nn.Linear case: x sharded on its last dim
                return _apply_conv1d(self, m, mesh)
            return super()._apply(m, mesh)

    return RowwiseParallel(**kwargs)


def fused_colwise(module: nn.Module, segments: tuple[int, ...], tp: int):
    """Column-parallel for a fused projection whose output is the concatenation of ``segments``."""
    return colwise(permutation=QKVPermutation(segments, tp, dim=1 if is_conv1d(module) else 0))


def _hidden_arg(args, kwargs):
    """Where a block (part) gets its hidden states: ("arg", 0) or ("kw", name), or None."""
    if args:
        return ("arg", 0)
    key = (next((k for k in ("hidden_states", "x", "input", "hidden") if k in kwargs), None)
           or next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None))
    return None if key is None else ("kw", key)


def block_input_style():
    """A ParallelStyle moving a block (part)'s hidden-state input from ``layout`` to ``desired``.

    Like PrepareModuleInput, but it finds the input whether the module is
    called positionally (``self.attn(x)``, GPT-2's ``block(h, cache, mask,
    ...)``) or by keyword (Hugging Face's ``self.self_attn(hidden_states=x,
    ...)``), where PrepareModuleInput's ``input_layouts`` fails with "module
    inputs and input_layouts should have same length!". By default the input
    becomes one replicated DTensor, so q, k and v (or gate and up) share one
    gather; ``local=True`` hands the module a plain tensor (the first
    block's sequence shard under --sp).
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class BlockInput(ParallelStyle):
        def __init__(self, layout, desired=None, local: bool = False):
            super().__init__()
            self.layout, self.desired, self.local = layout, desired or Replicate(), local
            self.input_layouts, self.desired_input_layouts = (layout,), (self.desired,)  # for describe()

        def _apply(self, module, mesh):
            def convert(x):
                if not isinstance(x, torch.Tensor):
                    return x
                if not isinstance(x, DTensor):  # a local tensor in the region's layout
                    x = DTensor.from_local(x, mesh, (self.layout,), run_check=False)
                if tuple(x.placements) != (self.desired,):
                    x = x.redistribute(placements=(self.desired,))
                return x.to_local() if self.local else x

            def hook(_, args, kwargs):
                where = _hidden_arg(args, kwargs)
                if where is None:
                    return args, kwargs
                if where[0] == "arg":
                    return (convert(args[0]), *args[1:]), kwargs
                return args, {**kwargs, where[1]: convert(kwargs[where[1]])}

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return BlockInput


def block_output_style():
    """A ParallelStyle gathering a block's hidden-state output (a tensor, or a tuple's first item)
    from sequence shards into one whole local tensor (the last block's output under --sp)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class BlockOutput(ParallelStyle):
        def __init__(self):
            super().__init__()
            self.output_layouts, self.desired_output_layouts = (Shard(1),), (Replicate(),)  # for describe()

        def _apply(self, module, mesh):
            def gather(x):
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
                out = x.redistribute(placements=(Replicate(),)).to_local()
                # a stage's output under the zero-bubble schedules is detached in place once its input
                # gradients are computed (torch.distributed.pipelining), which a view refuses
                return out.clone() if out._is_view() else out

            def hook(_, args, out):
                if isinstance(out, tuple):
                    return (gather(out[0]), *out[1:])
                return gather(out)

            module.register_forward_hook(hook)
            return module

    return BlockOutput
