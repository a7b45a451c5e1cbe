"""How fast this rank's CPU computes in bf16 against fp32: the planner's compute term for 16-bit runs
on CPU ranks (``nbtool.plan.cpu_costs``).

The ratio depends on the CPU's instructions, not on the model: where bf16 is native (AVX512-BF16, AMX)
bf16 training steps ran 2.5x faster per FLOP than fp32 (cpu_costs' reference machine); on an AVX2-only
AMD EPYC VM one Linear layer's forward and backward ran 11-13x slower in bf16 (50 against 4.3 GFLOP/s),
and FSDP's bf16 steps took 3-5x the fp32 steps' time (0.1 -> 0.4-0.6 s on the tutorial shape). A
calibration from a run in one precision then predicted the other 5x off, in either direction.
"""
from __future__ import annotations

import functools
import time

SHAPE = (256, 128, 512)  # tokens x in x out: a transformer MLP's first matrix at the planner's test shapes
REPEATS = 5
# rounds of REPEATS per dtype, fp32 and bf16 in turn, the fastest round kept: on a 2-core VM one round
# read bf16 at 2.8-3.1 GFLOP/s in a slow spell and 4.0-4.4 outside it: a session whose probe read 3.0
# put its fsdp bf16 steps 10-41% long, the same runs judged with 4.1 -11..+10% (4 shapes x 2 runs)
ROUNDS = 3


@functools.lru_cache(maxsize=None)
def matmul_flops() -> tuple[float, float]:
    """(fp32, bf16) FLOP/s of one Linear layer's forward and backward on this thread's cores (6 m k n
    FLOP; per dtype the fastest of ROUNDS medians of REPEATS after a warm-up; once per process: 0.5-1 s
    where bf16 is emulated)."""
    m, k, n = SHAPE
    rounds = [(_seconds("float32"), _seconds("bfloat16")) for _ in range(ROUNDS)]
    return 6 * m * k * n / min(r[0] for r in rounds), 6 * m * k * n / min(r[1] for r in rounds)


def _seconds(dtype: str) -> float:
    import torch

    m, k, n = SHAPE
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, dtype=dt, requires_grad=True)
    w = torch.randn(n, k, dtype=dt, requires_grad=True)
    grad = torch.ones(m, n, dtype=dt)

    def once():
        torch.nn.functional.linear(x, w).backward(grad)

    once()  # the first call sets up the kernels
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return sorted(times)[REPEATS // 2]
