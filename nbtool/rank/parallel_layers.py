"""Megatron's tensor-parallel linear layers, written out by hand (the tutorial's "underneath").

A linear layer computes Y = XA + b. Split A by columns over the p ranks of a
group, A = [A_1, ..., A_p]: rank i computes Y_i = X A_i + b_i, its slice of
the output's last dimension, with no communication (ColumnParallelLinear).
A following layer Z = YB splits B by rows, B = [B_1; ...; B_p], so that
Z = sum_i Y_i B_i: each rank multiplies the slice it already holds and one
all-reduce adds the partial products (RowParallelLinear). An MLP (column,
then row) therefore communicates once forward.

Two autograd functions carry the communication, Megatron's f and g:

- f, ``copy_to_parallel_region``: identity forward; backward all-reduces the
  gradient of X (every rank's slice of Y contributed to it);
- g, ``reduce_from_parallel_region``: all-reduce forward; identity backward
  (the gradient of a sum reaches every term unchanged).

So a column+row pair costs one all-reduce forward and one backward, which is
what ``%%distributed tp`` (DTensor ColwiseParallel / RowwiseParallel) does
for each attention and MLP block. The process group is passed in explicitly.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class _CopyToParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel_region(x, group=None):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x, group=None):
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromParallelRegion.apply(x, group)


def _shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    p, i = dist.get_world_size(group), dist.get_rank(group)
    if full.shape[dim] % p:
        raise ValueError(f"size {full.shape[dim]} along dim {dim} is not divisible by the group size {p}")
    return full.chunk(p, dim=dim)[i].clone()


def _init_shard(weight, full_shape, dim: int, group, init_method=None) -> None:
    """Megatron's initialisation: initialise the whole weight (same seed on every rank) and keep this
    rank's part, so the sharded layer starts as the nn.Linear it splits would (``init_method``
    defaults to nn.Linear's kaiming-uniform; biases start at zero, as Megatron's do)."""
    full = torch.empty(full_shape, dtype=weight.dtype, device=weight.device)
    (init_method or (lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5))))(full)
    with torch.no_grad():
        weight.copy_(_shard(full, dim, group))


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i: this rank's ``out_features / p`` output columns (the weight's rows).

    The input is replicated on every rank; the output stays split along its
    last dimension, ready for a RowParallelLinear (Megatron's gather_output=False).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 init_method=None):
        super().__init__()
        self.group = group
        p = dist.get_world_size(group)
        if out_features % p:
            raise ValueError(f"out_features {out_features} is not divisible by the group size {p}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // p, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // p)) if bias else None
        _init_shard(self.weight, (out_features, in_features), 0, group, init_method)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None) -> "ColumnParallelLinear":
        """This rank's shard of an existing (full, identical on every rank) nn.Linear."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group)
        with torch.no_grad():
            m.weight.copy_(_shard(linear.weight, 0, group))  # nn.Linear stores A transposed: rows = columns of A
            if m.bias is not None:
                m.bias.copy_(_shard(linear.bias, 0, group))
        return m

    def forward(self, x):
        return nn.functional.linear(copy_to_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i + b: rows ``in_features / p`` of B on each rank, one all-reduce forward.

    Takes the split output of a ColumnParallelLinear (Megatron's
    input_is_parallel=True); the bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 init_method=None):
        super().__init__()
        self.group = group
        p = dist.get_world_size(group)
        if in_features % p:
            raise ValueError(f"in_features {in_features} is not divisible by the group size {p}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // p))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        _init_shard(self.weight, (out_features, in_features), 1, group, init_method)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None) -> "RowParallelLinear":
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group)
        with torch.no_grad():
            m.weight.copy_(_shard(linear.weight, 1, group))
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, y_parallel):
        z = reduce_from_parallel_region(nn.functional.linear(y_parallel, self.weight), self.group)
        return z + self.bias if self.bias is not None else z
