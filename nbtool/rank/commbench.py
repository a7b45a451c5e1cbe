"""Engine side of ``%commbench``: timed collectives, measured like nccl-tests.

For each op and size: ``warmup`` untimed calls, then ``repeat`` batches of
``iters`` calls, each batch after a barrier and timed with the device
synchronised only around it (CUDA events on GPUs, the wall clock on CPU),
giving this rank's mean time per call in each repetition. Then one more call on freshly filled buffers (outputs cleared first) whose result is
checked element by element, so a broken collective is reported as wrong
rather than timed.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import protocol
from .bootstrap import rank_device
from .groups import subgroup



def _buffers(op: str, count: int, n: int, me: int, dtype, device, inplace: bool):
    """(input, output) for one call; ``count`` elements is the op's S / element size."""
    def empty(k):
        return torch.empty(k, dtype=dtype, device=device)

    if op in ("all_reduce", "broadcast"):
        buf = empty(count)
        return buf, buf
    if op in ("all_gather", "reduce_scatter"):  # S = the gathered output / the unscattered input
        full = empty(count)
        part = full.narrow(0, me * (count // n), count // n) if inplace else empty(count // n)
        return (part, full) if op == "all_gather" else (full, part)
    if op == "all_to_all":
        return empty(count), empty(count)
    raise ValueError(op)


def _fill(op: str, inp, n: int, me: int) -> None:
    if op == "all_to_all":  # chunk j goes to rank j: value me * n + j
        inp.copy_((me * n + torch.arange(n, device=inp.device)).repeat_interleave(inp.numel() // n).to(inp.dtype))
    elif op == "broadcast":
        inp.fill_(1 if me == 0 else -1)
    else:
        inp.fill_(me + 1)


def _expected(op: str, out, n: int, me: int):
    if op in ("all_reduce", "reduce_scatter"):
        return torch.full_like(out, n * (n + 1) // 2)
    if op == "broadcast":
        return torch.ones_like(out)
    if op == "all_gather":
        return (torch.arange(n, device=out.device) + 1).repeat_interleave(out.numel() // n).to(out.dtype)
    if op == "all_to_all":  # chunk j came from rank j's chunk me
        return (torch.arange(n, device=out.device) * n + me).repeat_interleave(out.numel() // n).to(out.dtype)
    raise ValueError(op)


def _call(op: str, inp, out, group):
    if op == "all_reduce":
        dist.all_reduce(out, group=group)
    elif op == "broadcast":
        dist.broadcast(out, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, inp, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp, group=group)


def _timed_batch(op: str, inp, out, group, iters: int, cuda: bool) -> float:
    """Mean seconds per call of ``iters`` back-to-back calls, after a barrier (ranks start together)."""
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            _call(op, inp, out, group)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        _call(op, inp, out, group)
    return (time.perf_counter() - t0) / iters


def run_sweep(ops: list[str], counts: dict, dtype_name: str, iters: int, warmup: int,
              ranks: tuple[int, ...], inplace: bool, publish: bool = True, repeat: int = 1) -> list[dict]:
    """Time every (op, count); returns this rank's rows (empty on ranks outside ``ranks``).

    ``counts[op]`` lists element counts (each divisible by the group size
    where the op needs it). Rank ``ranks[0]`` publishes each row as it is
    measured so the kernel can plot the sweep live.
    """
    group = subgroup(ranks)
    me_global = dist.get_rank()
    if me_global not in ranks:
        return []
    n = len(ranks)
    me = ranks.index(me_global)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    device = rank_device()
    cuda = device.type == "cuda"
    rows = []
    for op in ops:
        for count in counts[op]:
            inp, out = _buffers(op, count, n, me, dtype, device, inplace)
            _fill(op, inp, n, me)
            for _ in range(warmup):
                _call(op, inp, out, group)
            samples = [_timed_batch(op, inp, out, group, iters, cuda) for _ in range(repeat)]
            # a fresh call on cleared buffers: a collective that writes nothing must show as wrong
            out.fill_(-7)
            _fill(op, inp, n, me)  # after the clear: in-place inputs are views of the output
            _call(op, inp, out, group)
            row = {"op": op, "count": count, "size_bytes": count * inp.element_size(), "dtype": dtype_name,
                   "rank": me_global, "seconds": sorted(samples)[len(samples) // 2], "samples": samples,
                   "wrong": int((out != _expected(op, out, n, me)).sum().item()),
                   "clock": "cuda_event" if cuda else "wall"}
            rows.append(row)
            if publish and me == 0:
                try:
                    from ipyparallel.datapub import publish_data

                    publish_data({protocol.commbench_key(op, count): row})
                except Exception:
                    publish = False
            del inp, out
    return rows
