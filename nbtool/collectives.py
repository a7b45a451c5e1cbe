"""Collective operations: names, the bytes each moves, and nccl-tests' bus-bandwidth factors.

Following nccl-tests (doc/PERFORMANCE.md), S is the size in bytes that
defines an operation's "size", algbw = S / t, and busbw = algbw * factor,
where the factor makes busbw comparable to the link bandwidth:

    op              S is                          factor
    all_reduce      the buffer                    2 (n - 1) / n
    all_gather      the total (gathered) output   (n - 1) / n
    reduce_scatter  the total (unscattered) input (n - 1) / n
    all_to_all      the total buffer              (n - 1) / n
    broadcast       the buffer                    1
    reduce          the buffer                    1
    send / recv     the buffer                    1
    barrier         0                             -
"""
from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv", "barrier")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0 if n > 1 else 0.0  # a group of one moves nothing
    if op in ("send", "recv"):
        return 1.0
    if op == "barrier":
        return 0.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def bandwidths(op: str, size_bytes: int, n: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second; zeros when the time is not positive."""
    if seconds <= 0 or size_bytes <= 0:
        return 0.0, 0.0
    alg = size_bytes / seconds
    return alg, alg * bus_factor(op, n)
