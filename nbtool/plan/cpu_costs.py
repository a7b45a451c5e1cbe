"""What a training step costs CPU ranks outside communication, by strategy: a measured model.

On CPU ranks the host's work per parameter tensor (autograd hooks, optimizer
kernels run one tensor at a time, FSDP2's and tensor parallelism's DTensor
dispatch, ZeRO-3's per-parameter fetch and release) is a large part of a step
and differs by strategy up to 5x, where the FLOP term is the same; GPU ranks
hide most of it behind their kernels. So on CPU ranks the planner's compute
term is

    host_speed x (S_PER_GFLOP x GFLOP per rank + S_PER_TENSOR[strategy] x parameter tensors per rank)

(S_PER_GFLOP_16BIT for bf16 / fp16 runs) with the constants below fitted by
``benchmarks/fit_cpu_costs.py`` (least squares on relative error) to 48 runs
of ``benchmarks/plan_accuracy.py``: two runs of 3 model shapes x 8
strategies, each strategy's median of 3 interleaved runs, the time per step
being the median of steps 2..N; 2 gloo ranks of a 2-core x86 VM (AMD EPYC),
torch 2.13 CPU build, one thread per rank. There ``host_speed`` is 1; a run
on another machine calibrates it (``nbtool.plan.versus.calibrate``: its
measured time outside communication over this model's). bf16 matmuls ran
about 2.5x faster per FLOP than fp32 on this CPU (the wide shape's fsdp: 57
against 114 ms), hence the second FLOP rate. That rate is the CPU's, not
the model's: where the ranks measured theirs (``Hardware.matmul_flops``,
nbtool.rank.matmul_probe) a bf16 run's FLOPs take their time at the measured
bf16 rate instead, not scaled by ``host_speed`` (which, on CPU ranks, is
mostly the host's per-tensor work). On an AVX2-only AMD EPYC VM, where bf16 is
emulated (4.3 against fp32's 50 GFLOP/s in the probe), fsdp bf16 compute was
predicted within -5..+7% on the deep and Llama shapes and -5..-20% on the
tutorial's; the fp32 rate x host_speed x the probe's ratio had put it +14% to
+95% off, the reference's bf16 rate -81%.

Fitted on models of 38-198 parameter tensors and 0.3-6 GFLOP per rank per
step: in sample 43 of 48 runs within 25% (median 9%, worst 35%, deep tp).
Fitted on the first of the two runs alone, the second, out of sample, had 18
of 24 within 25% (median 16%, worst 44%): the same cell's time moves that
much between runs 20 minutes apart on this machine. Outside that range it is
rougher: with a 2-sample batch of the default TinyTransformer an earlier fit
put zero3 at 2x its time.
"""
from __future__ import annotations

from .layouts import Layout

S_PER_GFLOP = 15.9e-3  # forward + backward, 6 Psi tokens, fp32; about 63 GFLOP/s per rank
S_PER_GFLOP_16BIT = 6.24e-3  # in bf16 / fp16 (FSDP's MixedPrecisionPolicy): about 160 GFLOP/s per rank
S_PER_TENSOR = {  # seconds per parameter tensor a rank holds, per step
    "ddp": 0.104e-3,
    "zero1": 0.187e-3,
    "zero2": 0.174e-3,
    "zero3": 0.543e-3,
    "fsdp": 0.497e-3,
    "fsdp bf16": 0.606e-3,
    "tp": 0.505e-3,
    "pp": 0.294e-3,
}

# What each collective costs 2 gloo CPU ranks in training, per op: (alpha s, bus bytes/s), fitted by
# ``benchmarks/fit_cpu_costs.py --links`` on the median time per size of every collective the rank-0
# thread blocked on (from the later of both ranks' issue) in one plan_accuracy run of every shape and
# strategy. A quiet %commbench sweep of the same machine gives alpha 0.3 ms, B 1.2 GB/s: in training
# each collective also waits for the other rank, which arrives later by a jittery step of host work.
# gloo's reduce-scatter is an all-reduce plus flat copies: twice the time per bus byte of an all-gather.
COLLECTIVES = {
    "all_reduce": (805e-6, 1.001e9),
    "all_gather": (1149e-6, 0.939e9),
    "reduce_scatter": (1533e-6, 0.432e9),
    "all_gather (ZeRO-3 fetch)": (546e-6, 0.682e9),
}

# Tensor parallelism's all-reduces and a pipeline's sends and receives sit inside forward and backward,
# a few ms of host work apart; the thread blocks on each until the other rank gets there, so on top of
# the link time it waits out whatever delayed the other rank since the last one (a preemption, a halted
# vCPU's wake-up: this 2-core VM wakes one in about 4 ms). That wait grows with the work between them:
# beyond the table above, 0.17-0.37 x the step's compute for tp (the median by model shape, 5 shapes),
# 0.06-0.25 for pp. Per row, the median over its 47 runs (3 shapes x 3 repeats x 5 sessions, a Llama, a GPT-2) of
# ``plan_accuracy.py`` of (exposed comm measured - the link's time) / compute, fitted by
# ``benchmarks/fit_cpu_costs.py``; data parallelism's blocking collectives come after backward,
# where the ranks meet anyway, and the table's fit already holds their wait.
SYNC_WAIT = {"tp": 0.27, "pp": 0.18}

# Sequence parallelism's host work per all-gather or reduce-scatter (DTensor's redistribute: dispatch,
# the gathered output's cat, the shard's copy), seconds at host_speed 1: tp --sp's time outside
# communication less tp's, over host_speed x those collectives, in one plan_accuracy run of 4 shapes
# (tutorial, wide, deep, GPT-2: 0.35-0.91 ms; the median). Its all-gathers and reduce-scatters wait for
# the other rank no more than FSDP's, on whose runs the table above was fitted: no SYNC_WAIT for them.
S_PER_SP_COLLECTIVE = 0.60e-3


def _row(layout: Layout, precision: str) -> str:
    """The S_PER_TENSOR row for ``layout``; unmeasured layouts take their nearest (tp x pp: tp's;
    fsdp grad-op: fsdp's; ZeRO with offload or in 16 bits: its stage's)."""
    if layout.mesh:
        return "tp" if layout.key.startswith("tp") else "pp"
    if layout.is_fsdp:
        return "fsdp bf16" if precision in ("bf16", "fp16") else "fsdp"
    return layout.strategy


def step_s(layout: Layout, precision: str, gflop: float, tensors: float, host_speed: float = 1.0,
           bf16_flops: float | None = None) -> float:
    """Seconds per step outside communication (bubble excluded) on CPU ranks ``host_speed`` x the
    reference's, for ``gflop`` and ``tensors`` per rank; ``bf16_flops``: where the ranks measured it
    (nbtool.rank.matmul_probe), a bf16 run's FLOPs take their time at that rate, unscaled."""
    host = S_PER_TENSOR[_row(layout, precision)] * tensors
    if precision == "bf16" and bf16_flops:
        return host_speed * host + gflop * 1e9 / bf16_flops
    per_gflop = S_PER_GFLOP_16BIT if precision in ("bf16", "fp16") else S_PER_GFLOP
    return host_speed * (per_gflop * gflop + host)


def host_speed_of(layout: Layout, precision: str, gflop: float, tensors: float, compute_s: float,
                  bf16_flops: float | None = None) -> float:
    """The ``host_speed`` at which ``step_s`` gives the measured ``compute_s``; a bf16 run measured
    faster than its probed FLOP time alone (noise) scales the whole instead."""
    fixed = step_s(layout, precision, gflop, tensors, 0.0, bf16_flops)  # what host_speed does not scale
    scaled = step_s(layout, precision, gflop, tensors, 1.0, bf16_flops) - fixed
    return (compute_s - fixed) / scaled if compute_s > fixed else compute_s / (scaled + fixed)


def sync_wait_s(layout: Layout, compute_s: float) -> float:
    """Seconds per step the thread waits, beyond the link, for the other rank at collectives inside
    forward and backward (tensor and pipeline parallelism; 0 for the others) on CPU ranks."""
    return SYNC_WAIT.get(_row(layout, "fp32"), 0.0) * compute_s if layout.mesh else 0.0
