"""What a training step costs CPU ranks outside communication, by strategy: a measured model.

On CPU ranks the host's work per parameter tensor (autograd hooks, optimizer
kernels run one tensor at a time, FSDP2's and tensor parallelism's DTensor
dispatch, ZeRO-3's per-parameter fetch and release) is a large part of a step
and differs by strategy up to 5x, where the FLOP term is the same; GPU ranks
hide most of it behind their kernels. So on CPU ranks the planner's compute
term is

    host_speed x (S_PER_GFLOP x GFLOP per rank + S_PER_TENSOR[strategy] x parameter tensors per rank)

with the constants below fitted (least squares on relative error) to 24 runs
of ``benchmarks/plan_accuracy.py``: 3 model shapes x 8 strategies, 2 gloo
ranks of a 2-core x86 VM, torch 2.13 CPU build, one thread per rank. There
``host_speed`` is 1; a run on another machine calibrates it (``nbtool.plan.versus.calibrate``:
its measured time outside communication over this model's). bf16 is not
faster than fp32 on these CPUs (measured: the same or slower), so precision
enters only through fsdp's own bf16 row.

Fitted on models of 38-198 parameter tensors and 0.3-6 GFLOP per rank per
step (in-sample worst error 41%, deep fsdp); a second run of the benchmark,
out of sample and calibrated on another strategy's run, put 16 of 24 step
times within 25% (median 16%, worst 51%), where one FLOP rate for every
strategy had 3 of 24 (worst 510%). Outside that range it is rougher: with a
2-sample batch of the default TinyTransformer zero3 was predicted 2x its time.
"""
from __future__ import annotations

from .layouts import Layout

S_PER_GFLOP = 24.1e-3  # forward + backward, 6 Psi tokens; about 41 GFLOP/s per rank
S_PER_TENSOR = {  # seconds per parameter tensor a rank holds, per step
    "ddp": 0.343e-3,
    "zero1": 0.507e-3,
    "zero2": 0.417e-3,
    "zero3": 1.919e-3,
    "fsdp": 1.563e-3,
    "fsdp bf16": 1.643e-3,
    "tp": 1.560e-3,
    "pp": 0.752e-3,
}

def _row(layout: Layout, precision: str) -> str:
    """The S_PER_TENSOR row for ``layout``; unmeasured layouts take their nearest (tp x pp: tp's;
    fsdp grad-op: fsdp's; ZeRO with offload or in 16 bits: its stage's)."""
    if layout.mesh:
        return "tp" if layout.key.startswith("tp") else "pp"
    if layout.is_fsdp:
        return "fsdp bf16" if precision in ("bf16", "fp16") else "fsdp"
    return layout.strategy


def step_s(layout: Layout, precision: str, gflop: float, tensors: float, host_speed: float = 1.0) -> float:
    """Seconds per step outside communication (bubble excluded) on CPU ranks ``host_speed`` x the
    reference's, for ``gflop`` and ``tensors`` per rank."""
    return host_speed * (S_PER_GFLOP * gflop + S_PER_TENSOR[_row(layout, precision)] * tensors)
