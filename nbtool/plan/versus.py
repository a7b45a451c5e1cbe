"""Predicted next to measured for one recorded run, and a Hardware calibrated from a run.

Pure Python. ``versus(run, hw)`` asks the planner (nbtool.plan.estimate) to
predict the run it was given, with the model, batch and options the ranks
recorded, and puts each figure next to what was measured, saying what the
measurement is. ``calibrate(run)`` builds the Hardware that run implies: the
alpha-beta link fit from its own collectives (as ``%commbench`` fits its
sweep) and the compute rate it achieved. Predicting a run with the
calibration of the same run fits its times by construction, so the kernel
predicts each run from the previous one's calibration (and ``%commbench``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from .. import run_analysis
from ..spec import StrategySpec, bucket_element_bytes, pipeline_schedule
from . import cpu_costs
from .estimate import (DDP_INFLIGHT, MFU, P2P, REDUCE_BUCKET, REUSE_LIMIT, SP_GATHER, SP_SCATTER, ZERO3_FETCH, Estimate,
                       estimate, sequence)
from .inputs import RECORDED_SHAPE, Hardware, ModelShape, Training
from .model_states import PERSISTENCE_THRESHOLD

# tolerances: exact for the ledger, 2% for bytes per step (a loss all_reduce of a few bytes rides along)
DETERMINISTIC = ("model states", "bus bytes / step")
TOLERANCE = {"model states": 0.0, "bus bytes / step": 0.02, "peak tensor memory": 0.10, "step time": 0.25}


@dataclass
class Row:
    figure: str
    measured: float | None
    predicted: float | None
    unit: str  # "B", "s", "tokens/s", "FLOP/s"
    source: str  # what the measured figure is
    tolerance: float | None = None  # relative; None: shown, not judged
    note: str = ""  # which term of the model is off, when it is

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if self.measured is None or self.predicted is None or not self.measured:
            return None
        return (self.predicted - self.measured) / self.measured

    @property
    def within(self) -> bool | None:
        err = self.error
        if err is None or self.tolerance is None:
            return None
        return abs(err) <= self.tolerance + 1e-12


@dataclass
class Versus:
    run_name: str
    rows: list
    estimate: Estimate
    hardware: Hardware
    hardware_source: str  # where the link and compute figures came from
    notes: list = field(default_factory=list)
    run: object = field(default=None, repr=False, compare=False)  # the RunRecords predicted
    calibrated_on: str | None = None  # the name of the run the hardware was calibrated on (None: itself or none)
    outside_fit: str = ""  # CPU ranks: where the model lies outside what cpu_costs was fitted on (its times rougher)

    def row(self, figure: str) -> Row:
        return next(r for r in self.rows if r.figure == figure)

    def cells(self, deterministic: bool = False) -> tuple[str, tuple, list[tuple]]:
        """(heading, column names, each shown row's cell texts): what the text table and the
        notebook's HTML table (nbtool.widgets.versus_table) both show; ``deterministic``: only the rows
        that do not vary between runs (bytes)."""
        from ..metrics import format_bytes

        def fmt(v, unit):
            if v is None:
                return "-"
            if unit == "B":
                return format_bytes(v)
            if unit == "s":
                return f"{v * 1e3:.1f} ms"
            return f"{v:.3g} {unit}"

        head = f"predicted vs measured, run {self.run_name!r}" + (
            "" if deterministic else f" (planner's link and compute: {self.hardware_source})")
        cells = [(r.figure, fmt(r.measured, r.unit), fmt(r.predicted, r.unit),
                  "-" if r.error is None else _percent(r.error)
                  + ("" if r.within is None else (" ok" if r.within else f" (> {r.tolerance:.0%})")),
                  r.source + (f"; {r.note}" if r.note else "")) for r in self.rows
                 if not deterministic or r.figure in DETERMINISTIC]
        return head, ("figure", "measured", "predicted", "error", "measured as"), cells

    def text(self, deterministic: bool = False) -> str:
        """The table; ``deterministic``: only the rows that do not vary between runs (bytes)."""
        head, cols, cells = self.cells(deterministic)
        lines = [head] + _columns(cols, cells)
        return "\n".join(lines + ([] if deterministic else [f"note: {n}" for n in self.notes]))

    __str__ = text
    __repr__ = text  # a returned table shows as the table, not as its fields (nbtool.predicted_vs_measured())


def _columns(cols, rows) -> list[str]:
    """A plain-text table: the header and each row, columns padded to their widest cell."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [cols, *rows]]


def _percent(x: float) -> str:
    return f"{x:+.1%}" if abs(x) >= 0.0005 else "+0.0%"  # no "-0.0%" for a few bytes' difference


def error_cells(results: list, deterministic: bool = False) -> tuple[tuple, list[list], str]:
    """(column names, one row of cell texts per run, the line below): the planner's error on each
    judged figure, per run (``%dist_compare``), as text (``error_table``) or HTML."""
    figures = DETERMINISTIC if deterministic else DETERMINISTIC + ("peak tensor memory", "step time")
    cells = []
    for v in results:
        row = [v.run_name]
        for f in figures:
            r = v.row(f)
            row.append("-" if r.error is None else _percent(r.error)
                       + ("" if r.within is None else " ok" if r.within else " off")
                       + (ROUGH if f == "step time" and v.outside_fit else ""))
        if not deterministic:  # times depend on the calibration: which run's
            row.append(repr(v.calibrated_on) if v.calibrated_on is not None else "itself")
        cells.append(row)
    cols = ("planner's error (predicted - measured) / measured",) + figures + (
        () if deterministic else ("calibrated on",))
    tol = ", ".join(f"{f} {TOLERANCE[f]:.0%}" for f in figures)
    median = "" if deterministic else "; step time: against the median of steps 2..N"
    rough = "" if deterministic or not any(v.outside_fit for v in results) else (
        f"; {ROUGH.strip()} a model outside what the CPU ranks' cost model was fitted on "
        f"({cpu_costs.FITTED_GFLOP[0]:g}-{cpu_costs.FITTED_GFLOP[1]:g} GFLOP and {cpu_costs.FITTED_TENSORS[0]}-"
        f"{cpu_costs.FITTED_TENSORS[1]} parameter tensors per rank per step), where its ratios between strategies "
        "are rougher")
    return cols, cells, (f"ok / off: within / outside the tolerance ({tol}){median}{rough}; "
                         "%dist_plan --vs NAME for a run's figures")


ROUGH = " *"  # marks a step time predicted for a model outside the CPU cost model's fitted range


def _outside_fit(run) -> str:
    """CPU ranks: where ``run``'s model lies outside what nbtool.plan.cpu_costs was fitted on, that
    sentence (a tiny model's ratios between strategies are rougher); else ""."""
    if not ran_on_cpu(run):
        return ""
    _, shape, training, tp, pp = planner_inputs(run)
    tokens = step_tokens(shape, training)
    return cpu_costs.outside_fit(6 * shape.params * tokens / (tp * pp) / 1e9, len(shape.numels) / pp)


def error_table(results: list, deterministic: bool = False) -> str:
    """One line per run: the planner's error on each judged figure (``%dist_compare``)."""
    cols, cells, below = error_cells(results, deterministic)
    return "\n".join(_columns(cols, cells) + [below])


def spec_of(run) -> StrategySpec:
    fields = run.description.spec
    return StrategySpec.from_dict(fields) if fields else StrategySpec(run.strategy)


def planner_inputs(run) -> tuple[str, ModelShape, Training, int, int]:
    """(layout, model shape, training setup, tp, pp) the planner needs to predict ``run``."""
    desc = run.description
    if not desc.param_numels:
        raise ValueError(f"run {run.name!r} has no model description (did the cell call strategy.prepare?)")
    spec = spec_of(run)
    batch = desc.batch or {}
    recorded = {k: v for k in RECORDED_SHAPE if (v := desc.model_shape.get(k)) is not None}
    if "ends" in recorded:  # lists in the record's JSON
        recorded["ends"] = tuple(tuple(part) for part in recorded["ends"])
    shape = ModelShape(sum(desc.param_numels), numels=tuple(desc.param_numels), seq=batch.get("seq"), **recorded)
    tp = pp = 1
    if desc.dims is not None:
        _, tp, pp = desc.dims
        layout = "tp-pp" if tp > 1 and pp > 1 else ("tp" if tp > 1 else "pp")
    elif run.strategy == "fsdp":
        layout = "fsdp" if spec.reshard_after_forward else "fsdp-grad-op"
    elif spec.is_zero and spec.offload:
        layout = {"zero2": "zero2-offload", "zero3": "zero3-offload" if spec.offload == "both"
                  else "zero3-offload-optimizer"}.get(run.strategy, run.strategy)  # no zero1 offload layout
    else:
        layout = run.strategy
    ledger = run_analysis.peak_ledger(run, 0)
    micro = batch.get("samples") or 1
    accum = (spec.microbatches or 2 * pp) if pp > 1 else spec.grad_accum
    if pp > 1:
        micro = max(1, micro // accum)  # the batch is split into micro-batches
    training = Training(micro_batch=micro, seq=batch.get("seq"), precision=desc.precision,
                        optimizer=_optimizer_of(ledger), grad_accum=accum,
                        checkpointing="full" if spec.activation_checkpointing is not None else "none")
    return layout, shape, training, tp, pp


def _optimizer_of(ledger: dict) -> str:
    """Adam (2 fp32 moments per element) or SGD with momentum (1) or plain SGD, from the state the
    ledger holds per fp32 element (the master copy where there is one, else the weights)."""
    if not ledger["optimizer_state"]:
        return "sgd"
    per = ledger["master_params"] or ledger["params"]
    return "sgd-momentum" if per and ledger["optimizer_state"] / per < 1.5 else "adamw"


def compress_factor(run) -> float:
    """DDP's gradient bytes per step under ``--compress`` over plain, as the mean of steps 2..N sees it:
    fp16/bf16 halve them; PowerSGD sends its P and Q factors (counted from the parameters' shapes, by
    powerSGD_hook's rule) from step START on, the whole gradients before."""
    from ..spec import compression

    chosen = compression(spec_of(run)) if run.strategy == "ddp" else None
    if chosen is None:
        return 1.0
    kind, _, start = chosen
    if kind != "powersgd":
        return 0.5
    counts = run.description.details.get("powersgd_elements") or {}
    if not counts.get("before"):
        return 1.0
    ratio = counts["after"] / counts["before"]
    steps = max((m.step for m in run.steps if m.rank == 0), default=0)
    # steps 2..N are averaged; steps 1..START are vanilla (PowerSGD counts from 0)
    vanilla = min(max(start - 1, 0), max(steps - 1, 0))
    return (vanilla + ratio * (steps - 1 - vanilla)) / (steps - 1) if steps > 1 else ratio


def layout_options(run) -> dict:
    """The estimate's keywords for the run's fsdp sharding (--dp-shard, --replicate, when it reduces
    accumulated gradients: --reduce-every-micro-batch), DDP's buckets
    (--bucket-mb), pipeline schedule (--schedule, --virtual-stages), sequence parallelism (--sp) and
    weights tied across stages."""
    from ..spec import hsdp_dims

    spec = spec_of(run)
    schedule, virtual = pipeline_schedule(spec)
    out = {"schedule": schedule, "virtual": virtual}
    details = run.description.details
    if run.strategy == "fsdp" and run.description.dims is None:
        dims = hsdp_dims(spec, run.world_size)
        out.update(shard=dims[1] if dims else None, whole=int(details.get("replicated_elements", 0)))
    elif run.description.dims is not None and run.description.dims[2] == 1:  # tp without pp: exact
        out["whole"] = int(details.get("tp_replicated_elements", 0))
        if "plan" in details:  # the parts it split: one row-parallel projection each
            out["tp_split_parts"] = sum(style.startswith("Rowwise") for style in details["plan"].values())
    elif "tp_by_pp_rank" in details:  # tp x pp: each pipeline rank's stages' figures
        out["whole"] = tuple(int(w) for w, _ in details["tp_by_pp_rank"])
        out["tp_split_parts"] = sum(parts for _, parts in details["tp_by_pp_rank"])
    elif run.strategy == "ddp" and spec.bucket_mb is not None:
        out["ddp_bucket"] = spec.bucket_mb * 2**20
    if run.strategy == "fsdp":
        out["reduce_every_micro_batch"] = bool(spec.reduce_every_micro_batch)
    if run.description.dims is not None:
        out.update(sp=bool(spec.sp), tied=tuple(details.get("pp_tied_elements", ())),
                   fsdp_dp=run.strategy == "fsdp", mesh_reshard=bool(spec.reshard_after_forward))
    return out


def zero_config(run) -> dict:
    """The zero_optimization section of the DeepSpeed config the run used ({} for other strategies)."""
    return (run.description.details.get("deepspeed_config") or {}).get("zero_optimization") or {}


def gradients_mb(shape: ModelShape, precision: str) -> int:
    """Whole MiB that hold every gradient of the model (ZeRO's reduce bucket counts the 16-bit dtype under
    bf16 / fp16)."""
    return math.ceil(shape.params * bucket_element_bytes(precision) / 2**20)


def reduce_bucket_bytes(run) -> int:
    """Bytes of the reduce bucket DeepSpeed allocated whole on each rank of a ZeRO ``run`` (0 for other
    strategies): reduce_bucket_size elements of the gradient dtype, twice under ZeRO-1/2's overlap_comm."""
    if not run.strategy.startswith("zero"):
        return 0
    zero = zero_config(run)
    copies = 2 if zero.get("overlap_comm") and run.strategy != "zero3" else 1
    return int(zero.get("reduce_bucket_size", REDUCE_BUCKET)) * bucket_element_bytes(planner_inputs(run)[2].precision) * copies


def typical_step(run, key: str = "seconds") -> float | None:
    """The median over steps 2..N on rank 0 of ``key`` (a step_table column: ``seconds``, ``compute_s``).

    The planner models a steady step. Measured on 2 CPU ranks, 3 of 12 six-step runs had a step at
    3-6x the others (a host stall, DDP's bucket rebuild), which moved the run's mean of 5 steps by up
    to 85%, and every prediction calibrated on that run with it. The median leaves such steps out.
    """
    steps = run_analysis.steady_steps(run)
    return statistics.median(s[key] for s in steps) if steps else None


def measured_compute_s(run) -> float | None:
    """Seconds per step on rank 0 its thread was not blocked on collectives: step time less exposed
    comm, the median of steps 2..N. In a pipeline, step time less the schedule's idle time (rank 0's
    waits, sends and receives outside its stage's forward and backward): the planner's bubble and
    point-to-point terms hold that. Elsewhere where blocking is not observable (DDP's reducer waits
    in C++, device clocks), step time less comm busy time (the collectives' in-flight union).

    The planner's step is compute + exposed comm, its links fitted on blocked time. Less busy time,
    ZeRO-3's compute had left out what ran while a prefetch was in flight (9% of its step on 2 CPU
    ranks), which neither term then predicted; and an interleaved pipeline's, whose receives are
    posted ahead and stay in flight while the stage computes, came out at a third of 1F1B's for the
    same work (4.8 ms against 14.6), so a run calibrated on it predicted every other 3x fast."""
    return _measured_compute(run)[0]


def _measured_compute(run) -> tuple[float | None, str]:
    """(measured_compute_s, what it took from the step time): one choice for the figure and its label."""
    steps = run_analysis.steady_steps(run)
    pipelined = run.description.dims is not None and run.description.dims[2] > 1
    if not pipelined and all(s["exposed_s"] is not None for s in steps):
        return (statistics.median(s["seconds"] - s["exposed_s"] for s in steps) if steps else None), \
            "the thread's time blocked on collectives"
    idle = run_analysis.schedule_idle(run) if pipelined else {}
    if timed := [s["seconds"] - idle[s["step"]] for s in steps if s["step"] in idle]:
        return statistics.median(timed), \
            "the schedule's idle time (waits, sends, receives outside the stage's forward and backward)"
    return (statistics.median(s["compute_s"] for s in steps) if steps else None), "comm busy time"


def link_seconds(run, rank: int = 0, blocking_only: bool = False, by_op: bool = False) -> dict:
    """Bus bytes (``by_op``: (op, bus bytes)) -> seconds on the link of each of ``rank``'s wall-timed
    collectives.

    An async collective's issue-to-completion time (DDP's buckets, FSDP's
    reduce-scatters) also holds its wait behind the previous one on its group
    (a group's collectives run in order) and for the last rank to issue it;
    fitted as they are, DDP's buckets gave alpha 5-13 ms against 0.1-0.2 ms.
    So each one counts from the later of the last rank's issue and the end of
    the previous one of its group (its size stands for the group) to its end.
    ``blocking_only``: only the collectives the thread blocked on (calibrate's
    choice on CPU ranks, where an async one shares the cores with the compute
    it overlaps: DDP's buckets took 6-9 ms "alone" where a blocking all-reduce
    of the same size took 2-6 ms).
    """
    last_issue: dict = {}
    for c in run.comms:
        last_issue[c.seq, c.op] = max(last_issue.get((c.seq, c.op), c.t_issue), c.t_issue)
    mine = sorted((c for c in run.comms if c.rank == rank and c.clock == "wall" and c.seconds > 0 and c.bus_bytes > 0
                   and not (blocking_only and c.asynchronous)), key=lambda c: c.t_issue)
    busy_until: dict = {}  # group size -> end of its latest collective
    out: dict = {}
    for c in mine:
        end = c.t_issue + c.seconds
        start = max(last_issue[c.seq, c.op], busy_until.get(c.group_size, c.t_issue))
        busy_until[c.group_size] = max(busy_until.get(c.group_size, end), end)
        # ended before the one ahead of it did (gloo's worker threads ran both at once): its own time
        key = (c.op, c.bus_bytes) if by_op else c.bus_bytes
        out.setdefault(key, []).append(end - start if end > start else c.seconds)
    return out


# the ops whose own link a run can fit (send/recv and broadcast take the generic link)
OWN_LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# how far apart a run's smallest and largest collective must be for a fit to tell latency from bandwidth
LINK_FIT_SPAN = 4


def op_links(run, blocking_only: bool) -> dict:
    """{op: (alpha, B)} fitted from ``run``'s own collectives of each op in OWN_LINK_OPS that it timed
    in at least 3 sizes spanning 4x or more, where the fit is sound (alpha >= 0, B > 0).

    Fewer sizes do not tell latency from bandwidth in training: an FSDP run's all-gathers of 140 and
    400 kB (its root unit and its blocks) took 1.9 and 1.1 ms; one tutorial fsdp run's alpha, fitted
    through the base link's bandwidth, came out at 0.3 ms where 54 runs pooled give 0.63 ms (and
    ZeRO-3's 70 fetches a step wait 0.6-0.9 ms each). Such ops keep the base's link."""
    from ..commbench import fit_alpha_beta

    per_op: dict = {}
    for (op, size), secs in link_seconds(run, blocking_only=blocking_only, by_op=True).items():
        if op in OWN_LINK_OPS:
            per_op.setdefault(op, {})[size] = statistics.median(secs)
    out = {}
    for op, points in per_op.items():
        sizes = sorted(points)
        if len(sizes) >= 3 and sizes[-1] >= LINK_FIT_SPAN * sizes[0]:
            fit = fit_alpha_beta("broadcast", run.world_size, sizes, [points[s] for s in sizes])  # bus bytes
            if fit.alpha_s >= 0 and 0 < fit.bus_bandwidth < float("inf"):
                out[op] = (fit.alpha_s, fit.bus_bandwidth)
    return out


def typical_link_points(run) -> dict:
    """{row: (collectives, bus bytes, seconds)} in a typical step of ``run`` on rank 0, each the median
    over steps 2..N-1: the figures the CPU preset's rows (cpu_costs.COLLECTIVES) model, and
    ``benchmarks/fit_cpu_costs.py --links`` fits them to. The rows: per op, the collectives the thread
    blocked on, in data-parallel runs (tensor parallelism's and a pipeline's wait for the other rank is
    cpu_costs.SYNC_WAIT's); sequence parallelism's gathers and scatters (tp --sp runs); ZeRO-3's
    fetches, the seconds waited on them; DDP's buckets, their in-flight union (the reducer's wait is in
    C++, unseen: the union is what DDP's measured compute leaves them)."""
    from collections import defaultdict

    sp = run.description.spec.get("sp")
    if run.description.dims is not None and not sp:
        return {}
    # sequence parallelism's gathers and scatters: rows of their own (its norms' one all-reduce a step,
    # tensor parallelism's, is left out)
    rows = {"all_gather": SP_GATHER, "reduce_scatter": SP_SCATTER} if sp else {op: op for op in OWN_LINK_OPS}
    last = max((m.step for m in run.steps if m.rank == 0), default=0)
    steps: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))  # row -> step -> figures
    waited = {}  # ZeRO-3's async all-gathers: seq -> record
    for c in run.comms:
        if c.rank != 0 or not 1 <= c.step <= last - 1 or c.bus_bytes <= 0:
            continue
        if not c.asynchronous and c.op in rows:
            step = steps[rows[c.op]][c.step]
            step[0], step[1], step[2] = step[0] + 1, step[1] + c.bus_bytes, step[2] + c.seconds
        elif c.asynchronous and c.op == "all_gather" and run.strategy == "zero3":
            waited[c.seq] = c
            step = steps[ZERO3_FETCH][c.step]
            step[0], step[1] = step[0] + 1, step[1] + c.bus_bytes
    for w in run.waits:
        if w.rank == 0 and w.seq in waited:
            steps[ZERO3_FETCH][waited[w.seq].step][2] += w.seconds
    out = {row: tuple(statistics.median(s[i] for s in by_step.values()) for i in range(3))
           for row, by_step in steps.items()}
    if run.strategy == "ddp" and (table := run_analysis.steady_steps(run)):
        out[DDP_INFLIGHT] = tuple(statistics.median(s[k] for s in table) for k in ("count", "bus_bytes", "comm_s"))
    return out


def ddp_buckets_link(run, hw: Hardware) -> tuple | None:
    """(alpha, B) of a DDP run's bucket all-reduces on CPU ranks: the preset's B, and the latency that
    puts buckets x alpha + bus bytes / B through their in-flight union in a typical step
    (``typical_link_points``). The preset's row, fitted on other machines' runs of a few buckets a
    step, had put a ``ddp --bucket-mb 0.05`` run's 8 buckets at 43 ms a step where they took 19 (the
    run, calibrated on itself, read +136%). The other rows stay the preset's where a run cannot fit
    its own link (``op_links``): their seconds include the wait for the other rank, which grows with
    the host's work, and a run's own rows carried into another line's prediction missed more (108 runs
    of benchmarks/plan_accuracy.py: 32 of 36 within 25% against 34; fsdp bf16 from fsdp -26% where
    the preset gave -3.5%). None where the run timed no bucket."""
    point = typical_link_points(run).get(DDP_INFLIGHT)
    if point is None or point[0] < 1 or point[2] <= 0:
        return None
    count, bus, seconds = point
    _, bw = hw.bandwidth(run.world_size, DDP_INFLIGHT)
    return max(0.0, (seconds - bus / bw) / count), bw


def with_timeline(run) -> bool:
    """Whether ``run``'s step times hold a --memory-timeline's bookkeeping (not where the timeline
    stopped following the cell and 2 or more steps ran after it: those are timed)."""
    return run_analysis.steps_hold_timeline(run)


def ran_on_cpu(run) -> bool:
    """Whether ``run``'s ranks were CPU ranks (no CUDA allocator figures, no device-timed collectives)."""
    return all(m.cuda_peak is None for m in run.memory) and all(c.clock == "wall" for c in run.comms)


def calibrate(run, base: Hardware | None = None, host_speed: float | None = None) -> Hardware:
    """The Hardware ``run`` implies: its collectives' alpha-beta fit and its achieved compute rate.

    Link: a weighted least-squares fit of seconds = alpha + bus bytes / B over
    the median time per size of the run's wall-timed collectives, each timed on
    the link alone (``link_seconds``; the slope between the smallest and
    largest size where the fit comes out negative); on CPU ranks only the collectives the thread
    blocked on, and where fewer than 2 sizes remain (DDP: all async) the CPU preset's link, named as
    such; sizes less than LINK_FIT_SPAN apart cannot tell latency from bandwidth: on CPU ranks the
    preset's B with the latency that fits the run's times, elsewhere the fit, named as barely
    constrained. Each of all_reduce, all_gather and reduce_scatter the run timed also gets its own link
    (``op_links``); the others keep the base's (on CPU ranks, the in-training table of
    nbtool.plan.cpu_costs.COLLECTIVES). Compute: peak_flops such that the planner's compute
    term (6 Psi tokens / (peak x utilisation)) equals the run's measured time
    outside communication. On CPU ranks, a run in bf16 whose time is mostly its bf16 FLOPs at the
    ranks' probed rate (the CPU emulates bf16) cannot tell the host's speed: a 10% miss of that rate
    had made the host's work 3x (an fp32 run after it predicted +211%). It calibrates bf16's rate in
    training instead and keeps ``host_speed`` (the run before's; else the CPU reference's).
    The returned Hardware's name says which of the two the run measured.
    """
    from ..commbench import fit_alpha_beta
    from .inputs import HARDWARE_PRESETS

    cpu = ran_on_cpu(run)
    if base is None and cpu:  # measured on this kind of machine: the link where the run cannot fit it
        base = replace(HARDWARE_PRESETS["2 CPU ranks (gloo)"], devices_per_node=run.world_size, measured=False)
    hw = base or Hardware("this machine", 1, run.world_size, 0.0, 0.0, 1e9, 1e9)
    what = []  # the figures this run measured, named in hw.name
    by_size = link_seconds(run, blocking_only=cpu)
    sizes = sorted(by_size)
    times = [statistics.median(by_size[k]) for k in sizes]  # one median per size: a few slow calls (a
    # straggler, a page fault) do not steer it
    span = f"{len(sizes)} sizes {sizes[-1] / sizes[0]:.1f}x apart" if sizes else ""
    if len(sizes) >= 2 and cpu and sizes[-1] < LINK_FIT_SPAN * sizes[0]:
        # sizes this close cannot tell latency from bandwidth (an FSDP run's 2 sizes 1.3x apart fitted B at
        # 15,900 GB/s): the CPU preset's B, and the latency that puts its line through the run's times
        bw = hw.intra_bw
        alpha = max(0.0, statistics.median(t - s / bw for s, t in zip(sizes, times)))
        hw = replace(hw, intra_latency=alpha, inter_latency=alpha, measured=True)
        what.append(f"link (alpha {alpha * 1e6:.0f} us, through the CPU preset's B {bw / 1e9:.2f} GB/s: the run "
                    f"blocked on {span}, too close to fit B)")
    elif len(sizes) >= 2:
        fit = fit_alpha_beta("broadcast", run.world_size, sizes, times)  # bus bytes: factor 1
        alpha, bw = fit.alpha_s, fit.bus_bandwidth
        if not (0 < bw < float("inf")) or alpha < 0:  # noisy in-flight times: the two ends' slope instead
            alpha = max(0.0, times[0] - sizes[0] * (times[-1] - times[0]) / (sizes[-1] - sizes[0]))
            bw = (sizes[-1] - sizes[0]) / max(times[-1] - times[0], 1e-9)
        hw = replace(hw, intra_latency=alpha, inter_latency=alpha, intra_bw=bw, inter_bw=bw, measured=True)
        narrow = f"; from {span}: B barely constrained" if sizes[-1] < LINK_FIT_SPAN * sizes[0] else ""
        what.append(f"link (alpha {alpha * 1e6:.0f} us, B {bw / 1e9:.2f} GB/s{narrow})")
    elif cpu:
        what.append(f"link: the CPU preset's (alpha {hw.intra_latency * 1e6:.0f} us, B {hw.intra_bw / 1e9:.2f} GB/s; "
                    "the run blocked on fewer than 2 sizes of collective)")
    if own := op_links(run, blocking_only=cpu):
        hw = replace(hw.with_op_links(own), measured=True)
        what.append("per op: " + ", ".join(f"{op} (alpha {a * 1e6:.0f} us, B {b / 1e9:.2f} GB/s)"
                                           for op, (a, b) in sorted(own.items())))
    if cpu and run.strategy == "ddp" and (buckets := ddp_buckets_link(run, hw)):
        hw = replace(hw.with_op_links({DDP_INFLIGHT: buckets}), measured=True)
        what.append(f"DDP's buckets (alpha {buckets[0] * 1e6:.0f} us through the CPU preset's B "
                    f"{buckets[1] / 1e9:.2f} GB/s: their in-flight union)")
    compute = measured_compute_s(run)
    try:
        layout, shape, training, tp, pp = planner_inputs(run)
    except ValueError:
        return replace(hw, name=", ".join(what) or "nothing measured")
    tokens = step_tokens(shape, training)
    if compute and tokens:
        mixed = training.precision in ("bf16", "fp16")
        flops = 6 * shape.params * tokens * (4 / 3 if training.checkpointing == "full" else 1) / (tp * pp)
        hw = replace(hw, peak_flops=flops / compute / (MFU * (1 if mixed else 0.25)), measured=True)
        if cpu:  # the host's per-tensor work too, by strategy (nbtool.plan.cpu_costs), and how much
            # faster or slower bf16 computes here: a run in one precision predicts the other
            probe = run.description.matmul_flops
            hw = replace(hw, matmul_flops=tuple(probe) if probe else hw.matmul_flops)
            # the planner's whole compute term, which is linear in host_speed (cpu_costs' per-tensor work,
            # and sequence parallelism's per-collective work on top): inverted as a whole, so a run
            # calibrated on itself predicts its own compute (tp --sp's had come out 44% over)
            at = lambda speed: run_estimate(run, replace(hw, host_speed=speed)).compute_s
            fixed = at(0.0)  # bf16's FLOPs at the probed rate
            scaled = at(1.0) - fixed  # the host's work at host_speed 1; the speed found from it does not
            # depend on the kept speed's rounding (two runs of the same records, calibrated after different
            # runs, had differed in the last digit)
            kept = host_speed or (base.host_speed if base is not None and base.host_speed else 1.0)
            host = kept * scaled  # the host's work at that speed
            rated, probed = None, hw.bf16_flops  # rated: bf16's FLOP rate in this run's training, where the
            # run tells that and not the host's speed
            if fixed > compute / 2 and compute > host:
                rated = flops / (compute - host)
                hw = replace(hw, host_speed=kept, matmul_flops=(hw.matmul_flops[0], rated))
            else:  # a bf16 run measured faster than its probed FLOP time alone (noise) scales the whole
                speed = (compute - fixed) / scaled if compute > fixed else compute / (scaled + fixed)
                hw = replace(hw, host_speed=speed)
        what.append(f"compute rate ({flops / compute / 1e9:.3g} GFLOP/s achieved"
                    + (" with --memory-timeline's bookkeeping" if with_timeline(run) else "")
                    + (f"; time outside communication x{hw.host_speed:.2f} the CPU reference's" if cpu else "")
                    + (" (kept: this bf16 run's time is mostly its FLOPs)" if cpu and rated else "")
                    + (f"; bf16 at {hw.bf16_flops / 1e9:.2g} GFLOP/s, x{hw.speedup_16bit:.2g} fp32's, measured"
                       + (" in this run's training (the ranks' probe: "
                          f"{probed / 1e9:.2g})" if rated else "") if cpu and hw.matmul_flops else "") + ")")
    return replace(hw, name=", ".join(what) or "nothing measured")


def run_estimate(run, hw: Hardware, precision: str | None = None, training_changes: dict | None = None,
                 **changes) -> Estimate:
    """The planner's estimate of ``run`` on ``hw``, with the options the run used (DeepSpeed's config,
    DDP's compression, the layout's); ``precision``, ``training_changes`` (Training's fields: a
    pipeline's micro-batches) and ``changes`` (estimate's keywords) override them (advice: what a
    changed line would do)."""
    layout, shape, training, tp, pp = planner_inputs(run)
    if precision is not None:
        training = replace(training, precision=precision)
    if training_changes:
        training = replace(training, **training_changes)
    zero = zero_config(run)
    options = dict(persistence_threshold=int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD)),
                   reduce_bucket=int(zero.get("reduce_bucket_size", REDUCE_BUCKET)),
                   reuse_limit=int(min(zero.get("stage3_max_reuse_distance", REUSE_LIMIT),
                                       zero.get("stage3_max_live_parameters", REUSE_LIMIT))),
                   prefetch_bucket=zero.get("stage3_prefetch_bucket_size"),
                   compress=compress_factor(run), overlap_comm=bool(zero.get("overlap_comm", False)),
                   **layout_options(run))
    return estimate(layout, shape, training, hw, tp=tp, pp=pp, **{**options, **changes})


def versus(run, hw: Hardware, hardware_source: str, calibrated_on: str | None = None,
           calibration_run=None) -> Versus:
    """Each figure of ``run`` next to the planner's prediction with ``hw`` (see the module docstring);
    ``calibrated_on``: the name of the run ``hw`` was calibrated on, which a note may name;
    ``calibration_run``: that run, whose model a note may say is outside the CPU cost model's fit."""
    from ..metrics import format_bytes

    layout, shape, training, tp, pp = planner_inputs(run)
    hw = replace(hw, nodes=1, devices_per_node=run.world_size)
    workspace = max((m.cuda_workspace for m in run.memory if m.cuda_workspace is not None), default=None)
    if workspace is not None:  # what cuBLAS held on the ranks, measured when the run ended
        hw = replace(hw, workspace=workspace)
    e = run_estimate(run, hw)
    summary = run_analysis.summary(run)
    rows, notes = [], []
    states = {r: sum(led.values()) for r, led in summary["ledger"].items()}
    predicted_states = sum(e.states.values())
    mesh = layout.startswith(("tp", "pp"))
    tp_exact = mesh and pp == 1 and "tp_replicated_elements" in run.description.details
    # a pipeline (of plain replicas, or FSDP over dp): each rank's stages' parameters, counted from the
    # model's ends (a run recorded before runs recorded them is split evenly, unjudged); with tp, what
    # its plan left whole on each pipeline rank
    pp_exact = mesh and pp > 1 and bool(shape.ends) and (tp == 1 or "tp_by_pp_rank" in run.description.details)
    exact = tp_exact or pp_exact
    # the planner counts the collectives exactly: tensor parallelism's from the parts the plan split (parts
    # it left whole issue none: nanoGPT's attention), alone or inside FSDP over dp (its units' gathers and
    # reduce-scatters); a pipeline's sends and receives, and its replicas' all-reduce or FSDP's collectives
    bytes_exact = (tp_exact and "plan" in run.description.details
                   and (tp == run.world_size or run.strategy == "fsdp")) or pp_exact
    # the planner's states are the ledger theory's (exact) for data parallelism, ZeRO in bf16 and with
    # offload included (its peak's figures are DeepSpeed's estimator's there: nbtool.plan.estimate)
    rows.append(Row("model states", max(states.values(), default=None), predicted_states, "B",
                    "ledger (bytes of the tensors each rank owns), max rank",
                    TOLERANCE["model states"] if not mesh or exact else None,
                    "" if exact or not mesh else f"the planner splits every parameter over tp"
                    f"{' x pp' if pp > 1 and not shape.ends else ''}; embeddings, norms and biases stay whole"))
    if len(set(states.values())) > 1:  # ranks differ (pipeline stages, uneven shards): each one's
        per_stage = run.world_size // pp if len(e.rank_states) > 1 else 0  # the mesh's pp dim is outermost
        rows += [Row(f"  model states, rank {r}", b,
                     sum(e.rank_states[r // per_stage].values()) if per_stage else predicted_states, "B", "ledger",
                     TOLERANCE["model states"] if pp_exact else None)
                 for r, b in sorted(states.items())]
    by_op = ", ".join(f"{op} {format_bytes(b)}" for op, b in summary["comm_bytes_per_step"].items() if b)
    rows.append(Row("bus bytes / step", summary["bus_bytes_per_step"] or None, e.comm_bus_bytes, "B",
                    f"recorder: S x nccl-tests bus factor per collective, mean of steps 2..N (S by op: {by_op})",
                    TOLERANCE["bus bytes / step"] if not mesh or bytes_exact else None))
    peak, source, parts = peak_tensors(run)
    if workspace is not None and peak is not None:
        source += f"; {format_bytes(workspace)} of it cuBLAS workspaces (measured at the run's end), predicted alike"
    rows.append(Row("peak tensor memory", peak, e.device_total, "B", source,
                    TOLERANCE["peak tensor memory"] if peak is not None else None,
                    _activation_note(parts, e, pipeline_schedule(spec_of(run))[0] if pp > 1 else "")
                    if peak is not None else ""))
    bucket = reduce_bucket_bytes(run)
    if peak is None and bucket >= e.device_total / 2:  # measured, the advice says what to change
        notes.append(f"DeepSpeed's reduce bucket ({format_bytes(bucket)}, allocated whole) is "
                     f"{bucket / e.device_total:.0%} of the predicted peak; --reduce-bucket-mb "
                     f"{gradients_mb(shape, training.precision)} holds every gradient (run with --memory-timeline "
                     "to measure the peak and be advised)")
    # the same measure on both sides: on CUDA ranks the allocator's peak, else tracked tensors
    cuda = any(m.cuda_peak is not None for m in run.memory)
    typical = steps_cuda_peak(run) if cuda else typical_peak(run)
    if peak and typical and peak > 1.05 * typical and cuda:
        notes.append(f"steps 2..N peak at {format_bytes(typical)} on the CUDA allocator (predicted "
                     f"{_percent((e.device_total - typical) / typical)}); the run's peak came before the first "
                     "optimizer step ended (the set-up: the model moved and wrapped, the optimizer's state "
                     "created), which the planner's step leaves out")
    elif peak and typical and peak > 1.05 * typical:  # not a typical step's: say where it came from
        step = run_analysis.peak_step(run)
        where = ("before the first optimizer step ended (the set-up: the model built and wrapped, the "
                 "optimizer's state created)" if step == 1 else
                 f"in step {step}, which held more than the others"
                 if step else "after the last optimizer step")
        notes.append(f"a typical step peaks at {format_bytes(typical)} of tracked tensors (median of steps 2..N, "
                     f"predicted {_percent((e.device_total - typical) / typical)}); the run's peak came {where}, "
                     "which the planner's typical step leaves out")
    step_s = typical_step(run) or None
    mean_s = summary["step_s"]
    stalls = f" (mean {mean_s * 1e3:.1f} ms: some steps stalled)" if step_s and mean_s > 1.1 * step_s else ""
    # --memory-timeline's bookkeeping is in this run's times (x1.10-x1.51 the step at the median by
    # strategy, x1.01-x2.03 single runs: benchmarks/plan_accuracy.py's pairs); the planner's step has none
    timeline = with_timeline(run)
    rows.append(Row("step time", step_s, e.step_s, "s",
                    f"wall time on rank 0, median of {run_analysis.steady_span(run)}{stalls}",
                    None if timeline else TOLERANCE["step time"],
                    "not judged: --memory-timeline's bookkeeping is in it (x1.1-x1.5 the step by strategy here); "
                    "judge times on a run without it, or with 2 or more steps past --timeline-steps"
                    if timeline else ""))
    compute, what = _measured_compute(run)
    rows.append(Row("  compute", compute, e.compute_s, "s", f"step time minus {what}, median"))
    if training.precision == "bf16" and (emulated := hw.emulated_bf16()):
        notes.append(f"{emulated}, and the compute term uses that: on this machine fp32 trains faster")
    exposed = typical_step(run, "exposed_s") if summary["exposed_s_per_step"] is not None else None
    rows.append(Row("  exposed comm", exposed, e.exposed_comm_s, "s",
                    "thread blocked on collectives, median" if exposed is not None
                    else "not observable here (DDP's reducer waits in C++; CUDA ranks time the device)"))
    if exposed is not None and e.exposed_comm_s >= e.comm_s - 1e-12:  # every collective predicted exposed
        rows += _op_rows(run, e, hw)
    if pp > 1:
        bubble = run_analysis.bubble_table(run)
        measured = statistics.fmean(b["idle_s"] for b in bubble) if bubble else None
        # the stages' idle time holds their sends, receives and waits as well as theory's bubble
        idle = e.bubble_s + e.comm_s_by_op(hw).get(P2P, 0.0)
        rows.append(Row("  bubble", measured, idle, "s", "pipeline stages' idle time (span less the stage's "
                        "forward and backward), mean over stages; predicted: bubble + sends, receives and waits"))
    tokens = training.micro_batch * (training.seq or 0) * training.grad_accum * e.dp
    if tokens and step_s:
        rows.append(Row("throughput", tokens / step_s, tokens / e.step_s, "tokens/s",
                        "tokens per step / median step time"))
        flops = 6 * shape.params * tokens / run.world_size
        rows.append(Row("achieved FLOP/s per rank", flops / step_s, flops / e.step_s, "FLOP/s",
                        "estimate: 6 Psi per token / median step time"))
    i = next(i for i, r in enumerate(rows) if r.figure == "step time")
    note, term = _step_note(rows)
    rows[i] = replace(rows[i], note=rows[i].note or note)
    outside = _outside_fit(run)
    if term == "compute" and ran_on_cpu(run) and (hs := hw.host_speed):
        notes += _host_speed_note(run, hs, outside, calibrated_on, calibration_run)
    if hw.measured is False:
        notes.append("link and compute figures are presets; run a strategy cell or %commbench to measure them")
    return Versus(run.name, rows, e, hw, hardware_source, notes + e.notes[:2], run=run, calibrated_on=calibrated_on,
                  outside_fit=outside)


def _step_note(rows: list) -> tuple[str, str | None]:
    """Where the step time is off beyond its tolerance: (a note naming the term of the planner's step
    (compute, exposed comm, bubble) that holds more than half of the miss, else each term's share;
    that term or None)."""
    by = {r.figure.strip(): r for r in rows}
    step = by["step time"]
    if step.within is not False:
        return "", None
    miss = step.predicted - step.measured
    terms = {name: by[name].predicted - by[name].measured for name in ("compute", "exposed comm", "bubble")
             if name in by and by[name].error is not None}
    ms = lambda x: f"{x * 1e3:+.1f} ms"
    top = max(terms, key=lambda name: abs(terms[name]), default=None)
    if top is not None and terms[top] * miss > 0 and abs(terms[top]) > abs(miss) / 2:
        return f"off mostly in {top}: {ms(terms[top])} ({_percent(by[top].error)}); the whole step {ms(miss)}", top
    return (f"the step's {ms(miss)} is spread: " + ", ".join(f"{name} {ms(d)}" for name, d in terms.items())
            + (" (the rest: communication in flight, not observable by term here)" if "exposed comm" not in terms
               else "")), None


def quoted(name: str) -> str:
    """A run's name as a magic line takes it: quoted where it holds a space."""
    return f'"{name}"' if " " in name else name


def step_tokens(shape: ModelShape, training: Training) -> int:
    """Tokens per rank per optimizer step: micro-batch x sequence x accumulation."""
    return training.micro_batch * sequence(shape, training)[0] * training.grad_accum


def _host_speed_note(run, speed: float, outside: str, calibrated_on: str | None = None,
                     calibration_run=None) -> list:
    """CPU ranks, compute off: the host speed this run implies next to the calibration's (``speed``).
    A factor 1.5 between them is beyond what the model's ratios between strategies missed by on the
    runs it was checked on (cpu_costs.RATIOS_CHECKED), so it points at a machine
    whose speed changed between the two runs (CI once ran a ddp cell at 2.7x this machine's typical
    time and the zero3 cell after it at 1.3x), which only running them again tells apart. With the
    calibration run's name (``calibrated_on``) it gives the line that predicts this run from a rerun. A model
    outside what the cost model was fitted on, this run's or the calibration run's (``calibration_run``),
    is named instead: notebook 06 calibrated a pipeline on a 32-wide tp run, whose host speed was 0.38x the
    pipeline's own, and the note had put that on the machine."""
    own = calibrate(run, host_speed=speed).host_speed  # a bf16 run dominated by its FLOPs keeps ``speed``
    if not own or own == speed or 1 / 1.5 < own / speed < 1.5:
        return []
    again = (f" (or run the {calibrated_on!r} cell again, then %dist_plan --vs {quoted(run.name)} --calibrate-on "
             f"{quoted(calibrated_on)})" if calibrated_on and calibrated_on != run.name else "")
    head = (f"this run's time outside communication implies a host x{own:.2f} the CPU reference's, where the "
            f"calibration had x{speed:.2f} ({own / speed:.2f}x): beyond what the model's ratios between strategies "
            f"missed by ({cpu_costs.RATIOS_CHECKED}, nbtool.plan.cpu_costs)")
    if outside:  # a tiny model's step (``outside``: _outside_fit's sentence for this run): its ratios between strategies are not what the fit saw (a slow
        # spell may add to it; only a rerun tells)
        return [f"{head}; this model's run is outside what those ratios were fitted on: {outside}, where they "
                f"are rougher; run both cells again: if it stays off, it is the model{again}"]
    if calibration_run is not None and (theirs := _outside_fit(calibration_run)):  # a rerun would not help
        return [f"{head}; the calibration run's model is outside what those ratios were fitted on: {theirs}, "
                f"where they are rougher; predict this run from a larger model's run: %dist_plan --vs "
                f"{quoted(run.name)} --calibrate-on NAME"]
    return [f"{head}, so the machine may have run at another speed in one of the two runs; run both cells again: "
            f"a machine's slow spell moves one of them, a model that is off stays off{again}"]


def _op_rows(run, e: Estimate, hw: Hardware) -> list:
    """Per op: blocked seconds per step (median over steps 2..N) next to count x alpha + bytes / B, with
    the counts when they differ (the term of the model that is off)."""
    named = lambda op: P2P if op in ("send", "recv") else op  # the planner counts both ends as one
    steps = run_analysis.steady_steps(run)
    predicted = e.comm_s_by_op(hw)
    counts: dict = {}
    for c in e.comms:
        counts[c.op] = counts.get(c.op, 0) + c.count
    per_step = []  # (seconds, count) by op, per step
    for s in steps:
        got: dict = {}
        for op, n in s["count_by_op"].items():
            seconds, count = got.get(named(op), (0.0, 0))
            got[named(op)] = (seconds + ((s["exposed_by_op"] or {}).get(op) or 0.0), count + n)
        per_step.append(got)
    rows = []
    for op in sorted(set(predicted) | {op for got in per_step for op in got}):
        measured = statistics.median(got.get(op, (0.0, 0))[0] for got in per_step) if per_step else None
        n = statistics.median(got.get(op, (0.0, 0))[1] for got in per_step) if per_step else 0
        if op not in counts:
            rows.append(Row(f"    {op}", measured, None, "s", "blocked on it, median; not in the planner's model"
                            f" ({n:g} a step: the cell's or nbtool's own)"))
            continue
        by_link: dict = {}  # an op's collectives may take different links (tp x fsdp: sp's gathers, fsdp's)
        for c in e.comms:
            if c.op == op:
                by_link[c.link or op] = by_link.get(c.link or op, 0) + c.count
        model = []
        for link, count in by_link.items():
            alpha, bw = hw.bandwidth(run.world_size, link, op)
            model.append(f"{count:g} x alpha {alpha * 1e6:.0f} us + bytes / B {bw / 1e9:.2f} GB/s"
                         + (f" ({link})" if len(by_link) > 1 else ""))
        note = f"{n:g} a step measured, the planner counts {counts[op]:g}" if abs(n - counts[op]) > 0.5 else ""
        wait = sum(c.wait_s for c in e.comms if c.op == op)
        rows.append(Row(f"    {op}", measured, predicted[op], "s",
                        "blocked on it, median; model: " + "; ".join(model)
                        + (f" + {wait * 1e3:.1f} ms waiting for the other rank's host work (CPU ranks)" if wait else ""),
                        note=note))
    return rows


def peak_tensors(run) -> tuple[float | None, str, dict]:
    """(peak tensor bytes of the busiest rank or None, what they are, their categories at that peak)."""
    cuda = [m.cuda_peak for m in run.memory if m.cuda_peak is not None]
    if cuda:
        return max(cuda), "CUDA allocator peak (max_memory_allocated since the run began), max rank", {}
    if run.timelines:
        _, parts = run_analysis.busiest_timeline(run).peak()
        return sum(parts.values()), "tracked tensors at their peak (--memory-timeline), max rank", parts
    return None, "not measured on CPU ranks without --memory-timeline", {}


def steps_cuda_peak(run) -> float | None:
    """The CUDA allocator's peak over steps 2..N, max rank (the recorder resets the counter when the
    first optimizer step ends); None on CPU ranks or before a second step."""
    after = [m.cuda_peak for m in run.memory if m.cuda_peak is not None and m.cuda_peak_since >= 1]
    return max(after) if after else None


def typical_peak(run) -> float | None:
    """The median over steps 2..N of each step's peak of tracked tensors, on the rank whose timeline
    peaks highest; None without a --memory-timeline of 3 or more steps."""
    busiest = run_analysis.busiest_timeline(run)
    if busiest is None:
        return None
    peaks = run_analysis.step_peaks(run).get(busiest.rank, {})
    return statistics.median(peaks.values()) if len(peaks) >= 2 else None


def _activation_note(parts: dict, e: Estimate, schedule: str = "") -> str:
    """Which term of the activations is off, where they are. ``schedule``: a pipeline's."""
    measured = sum(parts.get(c, 0) for c in ("activation", "temporary", "autograd_detail"))
    predicted = e.device.get("activations", 0)
    if not measured or not predicted:
        return ""
    ratio = measured / predicted
    if 0.8 <= ratio <= 1.25:
        return ""
    if ratio > 1 and schedule in ("zbv", "interleaved-zb"):
        # the same models under 1F1B came within 0.99-1.16x, ZB-V 1.29-1.56x (tutorial, deep, Llama shapes)
        why = ("the zero-bubble schedules split each backward into input and weight gradients, and a stage "
               "holds a micro-batch's saved tensors and the gradients between the two until its weight "
               "gradients run; the planner counts 1F1B's (ZB-V held 1.2-1.5x 1F1B's on 3 shapes, 2 CPU ranks)")
    else:
        why = ("this model's layers save more than the count for their kind (Korthikanti's GPT layer or the "
               "Llama-style one): e.g. an activation function written as several elementwise ops (GPT-2's tanh "
               "GELU), dropout masks, attention that runs unfused (a mask SDPA's fused kernel does not take)"
               if ratio > 1 else "the per-layer count does not fit this model")
    return f"activations measured {ratio:.2f}x predicted: {why}"
