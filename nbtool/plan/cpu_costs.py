"""What a training step costs CPU ranks outside communication, by strategy: a measured model.

On CPU ranks the host's work per parameter tensor (autograd hooks, optimizer
kernels run one tensor at a time, FSDP2's and tensor parallelism's DTensor
dispatch, ZeRO-3's per-parameter fetch and release) is a large part of a step
and differs by strategy up to 5x, where the FLOP term is the same; GPU ranks
hide most of it behind their kernels. So on CPU ranks the planner's compute
term is

    host_speed x (S_PER_GFLOP x GFLOP per rank + S_PER_TENSOR[strategy] x parameter tensors per rank)

(a pipeline's stage also pays per micro-batch, below)

with the constants below fitted by ``benchmarks/fit_cpu_costs.py`` to the
time outside communication (``nbtool.plan.versus.measured_compute_s``: step
time less the time blocked on collectives; a pipeline's, when fitted, less its
comm busy time, which holds the bubble: the planner adds that on top; now less
its schedule's idle time, about 5% more on 1F1B) of 283 runs of
``benchmarks/plan_accuracy.py`` in 14 sets, hours to days apart (5 model shapes:
TinyTransformer tutorial, wide and deep, a Llama, a GPT-2; 8 strategies; one
set of pipelines with 2, 4 and 8 micro-batches), 2
gloo ranks of a 2-core x86 VM (AMD EPYC), torch 2.13 CPU build, one thread per
rank. Each set has its own host speed in the fit (this machine's speed moved
by up to 40% between sessions; the planner only uses the model's ratios
between strategies, a calibration run setting the speed), their geometric
mean 1: ``host_speed`` 1 is a typical session here, and a run on another
machine calibrates it (``nbtool.plan.versus.calibrate``: its measured time
outside communication over this model's). The earlier constants, fitted
with one speed for every session (and to the step less comm busy time),
predicted each set's median runs from its fsdp run with a median error of
13.7% (141 of 174 within 25%; by strategy ddp +16%, ZeRO-1 +24%, tp -16%,
pp +20%, the same sign on every shape); these, each set predicted by the fit
on the others, 8.0% (178 of 189).

A pipeline's stage runs its tensors' forward and backward, and the schedule
its own work, once per micro-batch: with the batch fixed, its time outside
communication grew x1.54-1.65 from 4 to 8 micro-batches and fell to
x0.83-0.87 from 4 to 2 (tutorial, deep and wide shapes), where one cost per
tensor had it flat. With a cost per tensor and micro-batch
(S_PER_TENSOR_MICROBATCH) and one per micro-batch (S_PER_MICROBATCH) the
model gives x1.14 (wide) to x1.54 (deep) and x0.73-0.93: the wide shape's
time is mostly FLOPs, and its smaller GEMMs (fp32 at 32 rows ran at 64% of
the rate at 256 here) are left out.

A bf16 run's FLOPs take their time at the ranks' measured bf16 rate
(``Hardware.matmul_flops``, nbtool.rank.matmul_probe), not scaled by
``host_speed`` (which, on CPU ranks, is mostly the host's per-tensor work);
S_PER_GFLOP_16BIT (bf16 2.5x faster per FLOP than fp32, an AVX512-BF16
machine's) stands where the ranks did not measure it. On an AVX2-only AMD
EPYC VM, where bf16 is emulated (4.3 against fp32's 50 GFLOP/s in the
probe), fsdp bf16 compute was predicted within -5..+7% on the deep and Llama
shapes and -5..-20% on the tutorial's; the fp32 rate x host_speed x the
probe's ratio had put it +14% to +95% off, the reference's bf16 rate -81%.

Fitted on models of 19-198 parameter tensors and 0.3-5.8 GFLOP per rank per
step; outside that range it is rougher: with a 2-sample batch of the default
TinyTransformer an earlier fit put zero3 at 2x its time.
"""
from __future__ import annotations

from .layouts import Layout

# the runs' range the constants were fitted on (the docstring's): GFLOP and parameter tensors per rank per step
FITTED_GFLOP = (0.3, 5.8)
FITTED_TENSORS = (19, 198)


def outside_fit(gflop: float, tensors: float) -> str:
    """Where a run's GFLOP and parameter tensors per rank per step fall outside what the constants were
    fitted on, that sentence (the ratios between strategies are rougher there); else ""."""
    out = [f"{what} {x:.2g} per rank per step (fitted on {lo:g}-{hi:g})"
           for what, x, (lo, hi) in (("GFLOP", gflop, FITTED_GFLOP), ("parameter tensors", tensors, FITTED_TENSORS))
           if not lo <= x <= hi]
    return " and ".join(out)


# how well the ratios between strategies below held: each set's median runs predicted from its fsdp run
# by the fit on the other sets (the docstring's 8.0%)
RATIOS_CHECKED = "178 of 189 runs within 25%"
S_PER_GFLOP = 18.7e-3  # forward + backward, 6 Psi tokens, fp32; about 54 GFLOP/s per rank
S_PER_GFLOP_16BIT = 6.24e-3  # in bf16 / fp16 where the ranks did not measure their rate: about 160 GFLOP/s
S_PER_TENSOR = {  # seconds per parameter tensor a rank holds, per step
    "ddp": 0.168e-3,
    "zero1": 0.216e-3,
    "zero2": 0.274e-3,
    "zero3": 1.059e-3,
    "fsdp": 0.855e-3,
    "fsdp bf16": 0.815e-3,
    "tp": 1.010e-3,
    "pp": 0.143e-3,
}
# and per parameter tensor and micro-batch: a pipeline stage runs its tensors' forward and backward once per
# micro-batch (smaller GEMMs, the same ops again), where the others run theirs once a step
S_PER_TENSOR_MICROBATCH = {"pp": 0.042e-3}
# and per micro-batch a stage runs, whatever its tensors: the schedule's own work for each forward and
# backward chunk (torch.distributed.pipelining's, the loss on the last stage)
S_PER_MICROBATCH = {"pp": 1.60e-3}

# What each collective costs 2 gloo CPU ranks in training: (alpha s, bus bytes/s) per row, fitted by
# ``benchmarks/fit_cpu_costs.py --links`` to a typical step (the median over steps) of each run of the
# 13 sets above (not the micro-batch one): per op, the count, bus bytes and seconds the rank-0 thread
# blocked on that op (the data-parallel runs: tp's and pp's wait for the other rank is SYNC_WAIT's);
# ZeRO-3's fetches, the seconds waited on them; DDP's bucket all-reduces, their in-flight union, which
# DDP's measured compute leaves to them (the reducer waits in C++, unseen; in flight as backward runs on
# the same cores, each took 5 ms, against the blocking all-reduce's 1.2). Least squares on log(predicted / measured): on the
# relative error the fit came out 7-48% short of the median step (blocked times are skewed by the
# waits for the other rank). A quiet %commbench sweep of the same machine gives alpha 0.3 ms, B 1.2
# GB/s: in training each collective also waits for the other rank, which arrives later by a jittery
# stretch of host work. gloo's reduce-scatter is an all-reduce plus flat copies. A pipeline's sends and
# receives: gloo's quiet point-to-point link, one way (a ping-pong of 4 kB-2 MB messages between 2 ranks
# here: 0.12 ms + bytes / 2.6 GB/s); what they wait for the other stage is SYNC_WAIT's. Their own row
# keeps a calibration run's generic link, fitted on other ops, off them: an FSDP run's had put the deep
# shape's 8 sends and receives a step at 24 ms where its whole time outside compute was 18. Sequence
# parallelism's activation all-gathers and reduce-scatters (25-200 kB each, 18-98 a step) have rows of
# their own too, fitted the same way on the tp --sp runs of 15 sets (27 runs; the fresh set judged in
# the README was kept out): the generic rows, fitted on FSDP's parameter gathers, had put them 25% and
# 15% over (the median over 35 runs: 1.31 and 2.18 ms a call where those rows gave 1.58-1.76 and 2.45-2.95).
COLLECTIVES = {
    "all_reduce": (1162e-6, 1.013e9),
    "all_gather": (1556e-6, 0.987e9),
    "reduce_scatter": (2382e-6, 0.346e9),
    "all_gather (ZeRO-3 fetch)": (641e-6, 0.733e9),
    "all_reduce (DDP bucket)": (5406e-6, 1.354e9),
    "send/recv": (120e-6, 2.6e9),
    "all_gather (sequence parallel)": (1199e-6, 0.586e9),
    "reduce_scatter (sequence parallel)": (1945e-6, 0.275e9),
}

# Tensor parallelism's all-reduces and a pipeline's sends and receives sit inside forward and backward,
# a few ms of host work apart; the thread blocks on each until the other rank gets there, so on top of
# the link time it waits out whatever delayed the other rank since the last one (a preemption, a halted
# vCPU's wake-up: this 2-core VM wakes one in about 4 ms). That wait grows with the work between them:
# beyond the table above, 0.13-0.26 x the step's compute for tp (the median by model shape, 5 shapes),
# for pp 0.16-0.25 on TinyTransformer's shapes and 0.31-0.40 on GPT-2's and the Llama's (whose last
# stage measured up to 30% slower than the first: rank 0 waits for it), beyond theory's bubble; a
# pipeline's time outside compute was then its comm busy time (now its schedule's idle time:
# nbtool.plan.versus.measured_compute_s, about 5% more compute on 1F1B; this machine's runs would fit
# pp 0.18 so, 0.28 the old way: kept with the host constants fitted beside it). Per row, the median
# over its runs (tp 19, pp 19, of the same sets) of (step time less measured compute - the link's time
# and the bubble) / predicted compute, fitted by ``benchmarks/fit_cpu_costs.py``; data parallelism's
# blocking collectives come after backward, where the ranks meet anyway, and the table's fit already
# holds their wait.
SYNC_WAIT = {"tp": 0.19, "pp": 0.24}

# Sequence parallelism's host work per all-gather or reduce-scatter (DTensor's redistribute: dispatch,
# the gathered output's cat, the shard's copy), seconds at host_speed 1: tp --sp's time outside
# communication less the model's for tp, over host_speed x those collectives, the median over the
# tp --sp runs of the same sets (5 shapes). Its all-gathers and reduce-scatters wait for
# the other rank no more than FSDP's, on whose runs the table above was fitted: no SYNC_WAIT for them.
S_PER_SP_COLLECTIVE = 0.79e-3


def _row(layout: Layout, precision: str) -> str:
    """The S_PER_TENSOR row for ``layout``; unmeasured layouts take their nearest (tp x pp: tp's;
    fsdp grad-op: fsdp's; ZeRO with offload or in 16 bits: its stage's)."""
    if layout.mesh:
        return "tp" if layout.key.startswith("tp") else "pp"
    if layout.is_fsdp:
        return "fsdp bf16" if precision in ("bf16", "fp16") else "fsdp"
    return layout.strategy


def step_s(layout: Layout, precision: str, gflop: float, tensors: float, host_speed: float = 1.0,
           bf16_flops: float | None = None, microbatches: int = 1, actions: float = 1.0) -> float:
    """Seconds per step outside communication (bubble excluded) on CPU ranks ``host_speed`` x the
    reference's, for ``gflop`` and ``tensors`` per rank and ``microbatches`` a step (a pipeline's
    stage runs its tensors' forward and backward once per micro-batch; only its row has terms for
    them); ``actions``: a pipeline rank's stage computations per micro-batch over 1F1B's
    (nbtool.spec.stage_actions: two stages per rank run twice the schedule's own work per micro-batch;
    on 2 CPU ranks, 4 micro-batches, interleaved 1F1B's step outside its idle time measured 7.5 ms over
    1F1B's 21.0, ZB-V's 16.1 ms over); ``bf16_flops``: where the ranks measured it
    (nbtool.rank.matmul_probe), a bf16 run's FLOPs take their time at that rate, unscaled."""
    row = _row(layout, precision)
    host = ((S_PER_TENSOR[row] + S_PER_TENSOR_MICROBATCH.get(row, 0.0) * microbatches) * tensors
            + S_PER_MICROBATCH.get(row, 0.0) * microbatches * actions)
    if precision == "bf16" and bf16_flops:
        return host_speed * host + gflop * 1e9 / bf16_flops
    per_gflop = S_PER_GFLOP_16BIT if precision in ("bf16", "fp16") else S_PER_GFLOP
    return host_speed * (per_gflop * gflop + host)


def sync_wait_s(layout: Layout, compute_s: float) -> float:
    """Seconds per step the thread waits, beyond the link, for the other rank at collectives inside
    forward and backward (tensor and pipeline parallelism; 0 for the others) on CPU ranks."""
    return SYNC_WAIT.get(_row(layout, "fp32"), 0.0) * compute_s if layout.mesh else 0.0
