"""Engine side of ``%commbench``: timed collectives, measured like nccl-tests.

Per op, ``repeat`` passes over the sizes, each timing one batch of ``iters``
calls per size (the first pass after ``warmup`` untimed calls per size, later
ones after one; with ``min_batch_s``, more calls for sizes whose batch would
be shorter, agreed by every rank). A batch starts after a barrier and is timed with the device
synchronised only around it (CUDA events on GPUs, the wall clock on CPU),
giving this rank's mean time per call in each repetition. Passes rather than
a size's batches back to back: a machine whose speed drifts over seconds
(a shared host's memory bandwidth) then moves every size alike instead of
bending the curve, and each size's median samples the whole sweep's time;
the first pass draws the whole curve early. Every size uses a prefix of one
buffer of the op's largest size, as nccl-tests does. After the passes, one
more call per size on freshly filled buffers (outputs cleared first) is
checked element by element, so a broken collective is reported as wrong
rather than timed.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .. import protocol
from .bootstrap import rank_device
from .groups import subgroup



def _buffers(op: str, count: int, n: int, me: int, inplace: bool, storage):
    """(input, output) for one call; ``count`` elements is the op's S / element size;
    ``storage(role, k)``: k elements of the role's buffer (prefixes of one allocation per role)."""
    if op in ("all_reduce", "broadcast"):
        buf = storage("buf", count)
        return buf, buf
    if op in ("all_gather", "reduce_scatter"):  # S = the gathered output / the unscattered input
        full = storage("full", count)
        part = full.narrow(0, me * (count // n), count // n) if inplace else storage("part", count // n)
        return (part, full) if op == "all_gather" else (full, part)
    if op == "all_to_all":
        return storage("in", count), storage("out", count)
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
              ranks: tuple[int, ...], inplace: bool, publish: bool = True, repeat: int = 1,
              min_batch_s: float = 0.0) -> list[dict]:
    """Time every (op, count); returns this rank's rows (empty on ranks outside ``ranks``).

    ``counts[op]`` lists element counts (each divisible by the group size
    where the op needs it). Rank ``ranks[0]`` publishes each row after each
    pass (its median so far) so the kernel can plot the sweep live. With
    ``min_batch_s``, a size whose ``iters`` calls would take less gets more
    (``_calls``), so a batch outlasts the scheduler's ticks and stalls.
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
        top = max(counts[op], default=0)
        pool: dict = {}

        def storage(role, k):
            if role not in pool:  # the role's largest size: "part" is a shard
                pool[role] = torch.empty(top // n if role == "part" else top, dtype=dtype, device=device)
            return pool[role][:k]

        bufs = {count: _buffers(op, count, n, me, inplace, storage) for count in counts[op]}
        samples: dict = {count: [] for count in counts[op]}
        calls = dict.fromkeys(counts[op], iters)
        for p in range(repeat):
            for count, (inp, out) in bufs.items():
                if p == 0:
                    _fill(op, inp, n, me)
                    for _ in range(warmup):
                        _call(op, inp, out, group)
                    if min_batch_s > 0:
                        calls[count] = _calls(op, inp, out, group, iters, min_batch_s, cuda)
                elif warmup:
                    _call(op, inp, out, group)
                samples[count].append(_timed_batch(op, inp, out, group, calls[count], cuda))
                if publish and me == 0:  # each pass redraws the size with its median so far
                    publish = _publish(_row(op, count, inp, dtype_name, me_global, samples[count], 0, cuda,
                                            calls[count]))
        for count, (inp, out) in bufs.items():
            # a fresh call on cleared buffers: a collective that writes nothing must show as wrong
            out.fill_(-7)
            _fill(op, inp, n, me)  # after the clear: in-place inputs are views of the output
            _call(op, inp, out, group)
            wrong = int((out != _expected(op, out, n, me)).sum().item())
            rows.append(_row(op, count, inp, dtype_name, me_global, samples[count], wrong, cuda, calls[count]))
        bufs.clear()  # before the next op allocates its own
        pool.clear()
    return rows


def _calls(op: str, inp, out, group, iters: int, min_batch_s: float, cuda: bool) -> int:
    """Calls per batch for this size: at least ``iters``, and enough that a batch lasts ``min_batch_s``.

    Probes of 4x more calls each until one lasts a quarter of the floor (a few calls alone would time
    the ranks' skew leaving the barrier, a vCPU's wake-up, not the calls); every decision is taken on
    the slowest rank's probe, agreed by an all-reduce, so every rank makes the same calls."""
    k = max(iters, 3)
    while True:
        took = torch.tensor([_timed_batch(op, inp, out, group, k, cuda) * k], dtype=torch.float64,
                            device=inp.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        seconds = float(took.item())
        if seconds >= min_batch_s / 4 or k >= 2**20:
            return max(iters, math.ceil(min_batch_s * k / max(seconds, 1e-9)))
        k *= 4


def _row(op: str, count: int, inp, dtype_name: str, rank: int, samples: list, wrong: int, cuda: bool,
         calls: int) -> dict:
    return {"op": op, "count": count, "size_bytes": count * inp.element_size(), "dtype": dtype_name, "rank": rank,
            "seconds": sorted(samples)[len(samples) // 2], "samples": list(samples), "iters": calls,
            "wrong": wrong, "clock": "cuda_event" if cuda else "wall"}


def _publish(row: dict) -> bool:
    """Sends the row to the kernel's live plot; False where datapub is unavailable (stop trying)."""
    try:
        from ipyparallel.datapub import publish_data

        publish_data({protocol.commbench_key(row["op"], row["count"]): row})
        return True
    except Exception:
        return False
