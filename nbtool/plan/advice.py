"""Advice on communication from a run's own numbers: at most three exact ``%%distributed`` lines.

Pure Python. Each suggestion names the line to run, why (the measured figure
that prompted it), and what the planner predicts it changes: bytes per step,
collectives per step, memory, step time. The kernel keeps the suggestions;
running a suggested line prints the measured change next to the predicted
one (``followed``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .. import run_analysis
from ..metrics import format_bytes
from ..spec import bucket_element_bytes, line_of
from .estimate import DDP_INFLIGHT, REDUCE_BUCKET, Estimate, estimate, fsdp_gathers
from .versus import (Versus, gradients_mb, peak_tensors, planner_inputs, quoted, ran_on_cpu, reduce_bucket_bytes,
                     run_estimate, spec_of, typical_step, zero_config)

MAX_SUGGESTIONS = 3
BUCKET_OPS = ("all_reduce",)
# a suggestion that saves memory, not time, is made when it saves at least this share of the peak
MEMORY_SHARE = 0.10


@dataclass
class Suggestion:
    line: str  # what follows %%distributed
    why: str
    figure: str  # the measured figure it moves: "bus bytes / step", "collectives / step", "bubble",
    # "exposed comm / step", "step time", "peak tensor memory"
    before: float  # measured on the run it was made from
    predicted: float  # the planner's figure after the change
    effect: str  # the predicted effect, for people
    base_run: str
    # the step time: the base run's (wall, median of steps 2..N) and the planner's change to it
    step_before: float | None = None
    step_change: float | None = None

    def text(self, i: int) -> str:
        return f"advice {i}: %%distributed {self.line}\n    {self.why}; predicted: {self.effect}"


def measure(run, figure: str) -> float | None:
    """The figure a suggestion moves, measured on ``run`` (rank 0, mean of steps 2..N; step time: median)."""
    summary = run_analysis.summary(run)
    if figure == "bus bytes / step":
        return summary["bus_bytes_per_step"]
    if figure == "collectives / step":
        return sum(n for op, n in summary["collectives_per_step"].items() if op in BUCKET_OPS)
    if figure == "exposed comm / step":
        return summary["exposed_s_per_step"]
    if figure == "bubble":
        rows = run_analysis.bubble_table(run)
        return sum(r["bubble"] for r in rows) / len(rows) if rows else None
    if figure == "step time":  # wall time, median of steps 2..N (as the table's row)
        return typical_step(run) or None
    if figure == "peak tensor memory":  # the table's row: the CUDA allocator's, or --memory-timeline's
        return peak_tensors(run)[0]
    raise ValueError(figure)


def suggest(run, result: Versus) -> list[Suggestion]:
    """Up to three suggestions for ``run`` that the planner predicts to save step time, the largest first."""
    spec = spec_of(run)
    _, shape, training, _, pp = planner_inputs(run)
    e, hw = result.estimate, result.hardware
    out = []
    summary = run_analysis.summary(run)
    step = typical_step(run) or None
    if spec.name == "ddp":
        buckets = measure(run, "collectives / step")
        grads_mb = 4 * shape.params / 2**20
        bucket_mb = max(1, math.ceil(grads_mb * 1.05))  # every gradient in one bucket
        if buckets >= 2 and (spec.bucket_mb or 25) < bucket_mb * 4:
            alpha, _ = hw.bandwidth(run.world_size, DDP_INFLIGHT, "all_reduce")
            e2 = run_estimate(run, hw, ddp_bucket=bucket_mb * 2**20)
            saved = e.step_s - e2.step_s
            out.append((saved, Suggestion(
                line_of(replace(spec, bucket_mb=float(bucket_mb))),
                f"{buckets:.0f} gradient all-reduces per step, each paying the link's latency "
                f"(alpha {alpha * 1e6:.0f} us)", "collectives / step", buckets, 1.0,
                f"1 all-reduce per step (all {format_bytes(4 * shape.params)} of gradients in one bucket), "
                f"{_step_effect(e, e2, step)}; no overlap of the all-reduce with backward left", run.name)))
    dims = run.description.dims  # (dp, tp, pp) of tp/pp layouts
    if spec.name == "fsdp" and spec.reshard_after_forward and (dims is None or dims[0] > 1):
        # fsdp --tp/--pp with the run's own options; a pipeline gathers each unit M + 1 times a step and
        # keeps them gathered from the first backward on anyway, so resharding saves it no memory
        e2 = (run_estimate(run, hw, mesh_reshard=False) if dims is not None
              else estimate("fsdp-grad-op", shape, training, hw))
        before = summary["bus_bytes_per_step"]
        after = before * _bytes_ratio(e, e2)
        extra = e2.device_total - e.device_total
        gathers = fsdp_gathers(True, training.grad_accum, pp > 1)
        times = "twice" if gathers == 2 else f"{gathers} times"
        out.append((e.step_s - e2.step_s, Suggestion(
            line_of(replace(spec, reshard_after_forward=False)),
            f"every unit is all-gathered {times} per step ({format_bytes(before)} bus bytes measured)",
            "bus bytes / step", before, after,
            f"bus bytes/step {format_bytes(before)} -> {format_bytes(after)} (no re-gather for backward), "
            f"memory {_signed_bytes(extra)} (units stay gathered from forward to backward), "
            f"{_step_effect(e, e2, step)}", run.name)))
    if spec.reduce_every_micro_batch:  # back to one reduce-scatter a window: faster, if memory allows
        e2 = run_estimate(run, hw, reduce_every_micro_batch=False)
        before = summary["bus_bytes_per_step"]
        after = before * _bytes_ratio(e, e2)
        out.append((e.step_s - e2.step_s, Suggestion(
            line_of(replace(spec, reduce_every_micro_batch=False)),
            f"each of the {training.grad_accum} micro-batches reduce-scatters every unit's gradients "
            f"({format_bytes(before)} bus bytes measured)", "bus bytes / step", before, after,
            f"bus bytes/step {format_bytes(before)} -> {format_bytes(after)} (one reduce-scatter a unit per step), "
            f"memory {_signed_bytes(e2.device_total - e.device_total)} (every unit's gradients held unsharded "
            f"in fp32 until the last micro-batch), {_step_effect(e, e2, step)}", run.name)))
    cuda = not ran_on_cpu(run)
    exposed = summary["exposed_s_per_step"] or 0.0
    # on CPU ranks DeepSpeed's reduction runs on the training thread whatever the flag (measured: the
    # same exposed time, and a second reduce bucket in memory), so only GPU runs are told to overlap
    if spec.is_zero and spec.stage < 3 and not spec.overlap_comm and cuda and exposed > 0.1 * summary["step_s"]:
        e2 = run_estimate(run, hw, overlap_comm=True)
        hidden = min(exposed, 2 / 3 * e.compute_s)  # at most the backward's length
        out.append((hidden, Suggestion(
            line_of(replace(spec, overlap_comm=True)),
            f"{exposed * 1e3:.1f} ms per step blocked on collectives ({exposed / summary['step_s']:.0%} of the step)",
            "exposed comm / step", exposed, exposed - hidden,
            f"gradients reduced while backward runs: exposed comm {exposed * 1e3:.1f} -> {(exposed - hidden) * 1e3:.1f} "
            f"ms at best (backward ~{2 / 3 * e.compute_s * 1e3:.1f} ms), memory +{format_bytes(e2.device_total - e.device_total)} "
            "(a second reduce bucket)", run.name)))
    if pp > 1:
        out += _pipeline(run, spec, shape, training, pp, e, hw, step)
    if spec.precision == "fp32" and spec.name in ("fsdp", "zero2", "zero3") and cuda:  # on CPU bf16 is no faster
        e2 = run_estimate(run, hw, precision="bf16")
        out.append((e.step_s - e2.step_s, Suggestion(
            line_of(replace(spec, precision="bf16")), "fp32 parameters are gathered in 4 bytes each",
            "bus bytes / step", summary["bus_bytes_per_step"],
            summary["bus_bytes_per_step"] * _bytes_ratio(e, e2),
            f"bus bytes/step x{_bytes_ratio(e, e2):.2f}, "
            f"{_step_effect(e, e2, step)}", run.name)))
    emulated = hw.emulated_bf16()
    if spec.precision == "bf16" and not cuda and emulated:
        e2 = run_estimate(run, hw, precision="fp32")
        before = typical_step(run)
        after = before * e2.step_s / e.step_s  # the measured step scaled by the predicted ratio
        if e2.step_s < 0.9 * e.step_s:  # a model this small spends its step elsewhere: not worth a line
            out.append((e.step_s - e2.step_s, Suggestion(
                line_of(replace(spec, precision="fp32")),
                emulated, "step time", before, after,
                f"step time {before * 1e3:.0f} -> {after * 1e3:.0f} ms (x{e2.step_s / e.step_s:.2f}), memory "
                f"{_signed_bytes(e2.device_total - e.device_total)}", run.name)))
    # only what the planner predicts to shorten the step (more micro-batches can cost more in sends
    # than they save in bubble: on CPU ranks each send pays ~0.3 ms); then what saves memory at no time
    out = sorted((x for x in out if x[0] > 0), key=lambda x: -x[0])
    faster = [replace(s, step_before=step, step_change=_step_change(e, e.step_s - saved, step))
              for saved, s in out[:MAX_SUGGESTIONS]]
    return faster + [replace(s, step_before=step) for s in
                     _memory(run, spec, shape, training, e, hw, step)[:MAX_SUGGESTIONS - len(faster)]]


def _pipeline(run, spec, shape, training, pp: int, e: Estimate, hw, step: float | None) -> list:
    """Where the pipeline idles over 15% of its step: twice the micro-batches (where the schedule's
    theory shrinks the bubble with them: not ZB-V's, 0 already), and for a one-stage-per-rank schedule
    two stages per rank (interleaved 1F1B: warm-up and drain of chunks half the size) where the blocks
    divide into 2 pp; each as the planner predicts it, with the run's schedule (suggest keeps those it
    predicts faster: on CPU ranks the extra sends can cost more than the bubble saves)."""
    from ..spec import SpecError, bubble_fraction, pipeline_schedule, validate

    bubble = measure(run, "bubble")
    if bubble is None or bubble <= 0.15:
        return []
    m = training.grad_accum
    schedule, virtual = pipeline_schedule(spec)
    theory = lambda mb, sch=schedule, v=virtual: bubble_fraction(pp, mb, sch, v)
    formula = "(p-1)/(m+p-1)" if virtual == 1 else f"{schedule}'s theory"
    out = []
    if theory(2 * m) < theory(m):
        e2 = run_estimate(run, hw, training_changes=dict(grad_accum=2 * m, micro_batch=max(1, training.micro_batch // 2)))
        out.append((e.step_s - e2.step_s, Suggestion(
            line_of(replace(spec, microbatches=2 * m)),
            f"the pipeline idles {bubble:.0%} of each step with {m} micro-batches", "bubble", bubble, theory(2 * m),
            f"bubble {theory(m):.0%} -> {theory(2 * m):.0%} in theory ({formula}), {_step_effect(e, e2, step)}",
            run.name)))
    interleaved = replace(spec, schedule="interleaved-1f1b")
    if virtual == 1 and shape.layers and shape.layers % (2 * pp) == 0:
        try:
            validate(interleaved, world_size=run.world_size)
        except SpecError:  # its micro-batches do not run in rounds of pp
            return out
        e2 = run_estimate(run, hw, schedule="interleaved-1f1b", virtual=2)
        after = theory(m, "interleaved-1f1b", 2)
        out.append((e.step_s - e2.step_s, Suggestion(
            line_of(interleaved), f"the pipeline idles {bubble:.0%} of each step; its {shape.layers} blocks "
            f"divide into 2 stages per rank", "bubble", bubble, after,
            f"bubble {theory(m):.0%} -> {after:.0%} in theory ((p-1)/(2m+p-1)), {_step_effect(e, e2, step)}, "
            f"memory {_signed_bytes(e2.device_total - e.device_total)}", run.name)))
    return out


def _step_change(e: Estimate, after_s: float, step: float | None) -> float:
    """A suggestion's predicted change of the step, in seconds: the planner's ratio (its step after,
    ``after_s``, over its step before) applied to the measured ``step``. Its own step can be further off
    than the change it predicts: its absolute change had predicted -4.3 ms for a ddp run that measured
    6.5 ms and the planner put at 19 ms."""
    return (after_s / e.step_s - 1) * (step or e.step_s)


def _step_effect(e: Estimate, e2: Estimate, step: float | None) -> str:
    """``_step_change`` as a suggestion writes it: ms and %."""
    return f"step time {_step_change(e, e2.step_s, step) * 1e3:+.1f} ms ({e2.step_s / e.step_s - 1:+.0%})"


def _bytes_ratio(e: Estimate, e2: Estimate) -> float:
    """The planner's bus bytes a step after a change over before (1 where it predicts none): applied to
    the measured bytes, the suggestion's figure."""
    return e2.comm_bus_bytes / e.comm_bus_bytes if e.comm_bus_bytes else 1.0


def _signed_bytes(n: float) -> str:
    """+1.5 MiB / -26.2 KiB: a predicted change of memory, one sign."""
    return f"{'+' if n >= 0 else '-'}{format_bytes(abs(n))}"


def _memory(run, spec, shape, training, e, hw, step: float | None) -> list[Suggestion]:
    """Made where the run's peak was measured (a GPU's allocator, --memory-timeline) and the change
    saves MEMORY_SHARE of the predicted peak or more.

    DeepSpeed allocates its reduce bucket whole (reduce_bucket_size elements, 5e8 by default: 1.86 GiB
    in fp32) whatever the model's size; one bucket that just holds every gradient reduces as often (once)
    and frees the rest. FSDP with gradient accumulation holds every unit's gradients unsharded in fp32
    between micro-batches; reduce-scattering each micro-batch's frees them for more bytes a step (the
    line says what that costs in time)."""
    before = measure(run, "peak tensor memory")
    if not before:
        return []
    if spec.name == "fsdp" and training.grad_accum > 1 and not spec.reduce_every_micro_batch:
        e2 = run_estimate(run, hw, reduce_every_micro_batch=True)
        saved = e.device_total - e2.device_total
        if saved < MEMORY_SHARE * e.device_total:
            return []
        return [Suggestion(
            line_of(replace(spec, reduce_every_micro_batch=True)),
            f"every unit's gradients are held unsharded in fp32 from the first of the {training.grad_accum} "
            f"micro-batches to the last: {saved / e.device_total:.0%} of the predicted peak beyond their shards",
            "peak tensor memory", before, before - saved,
            f"peak tensor memory {format_bytes(before)} -> {format_bytes(before - saved)} (-{format_bytes(saved)}), "
            f"bus bytes/step x{_bytes_ratio(e, e2):.2f} (a reduce-scatter a unit each "
            f"micro-batch), {_step_effect(e, e2, step)}", run.name, step_change=_step_change(e, e2.step_s, step))]
    if not spec.is_zero:
        return []
    per_element = bucket_element_bytes(training.precision)
    now = int(zero_config(run).get("reduce_bucket_size", REDUCE_BUCKET))
    mb = gradients_mb(shape, training.precision)
    elements = int(mb * 2**20) // per_element
    if elements >= now:
        return []
    e2 = run_estimate(run, hw, reduce_bucket=elements)
    saved = e.device_total - e2.device_total
    if saved < MEMORY_SHARE * e.device_total or e2.step_s > e.step_s:
        return []
    bucket = reduce_bucket_bytes(run)
    return [Suggestion(
        line_of(replace(spec, reduce_bucket_mb=float(mb))),
        f"DeepSpeed's reduce bucket ({now:,} elements{', twice: --overlap-comm' if bucket > now * per_element else ''}"
        f": {format_bytes(bucket)}) holds {format_bytes(shape.params * per_element)} of gradients; the "
        f"{format_bytes(saved)} it never fills are {saved / e.device_total:.0%} of the predicted peak",
        "peak tensor memory", before, before - saved,
        f"peak tensor memory {format_bytes(before)} -> {format_bytes(before - saved)} (-{format_bytes(saved)}), "
        f"{_step_effect(e, e2, step)} (as many reductions: every gradient fits one bucket)",
        run.name, step_change=_step_change(e, e2.step_s, step))]


# how each figure a suggestion moves is written (others: one decimal)
_FORMATS = {"bus bytes / step": format_bytes, "peak tensor memory": format_bytes, "bubble": lambda v: f"{v:.0%}",
            "exposed comm / step": lambda v: f"{v * 1e3:.1f} ms", "step time": lambda v: f"{v * 1e3:.1f} ms"}


def followed(run, suggestion: Suggestion) -> str:
    """The measured change next to the predicted one, for a run of a suggested line."""
    after = measure(run, suggestion.figure)
    fmt = _FORMATS.get(suggestion.figure, lambda v: f"{v:.1f}")
    moved = verdict(suggestion.before, after, suggestion.predicted)
    text = (f"advice followed (from run {suggestion.base_run!r}): {suggestion.figure} "
            f"{fmt(suggestion.before)} -> measured {fmt(after) if after is not None else '-'}, "
            f"predicted {fmt(suggestion.predicted)} ({moved})")
    if suggestion.figure != "step time" and suggestion.step_before and suggestion.step_change is not None:
        # the step time the suggestion also predicted (wall time, median of steps 2..N, as the table's row)
        before, step = suggestion.step_before, typical_step(run) or None
        ms = _FORMATS["step time"]
        if abs(suggestion.step_change) < 0.02 * before:  # predicted unchanged: how far it moved, no verdict
            text += (f"; step time {ms(before)} -> measured {ms(step) if step else '-'}, predicted unchanged"
                     + (f" ({(step - before) / before:+.0%})" if step else ""))
        else:
            predicted = before + suggestion.step_change
            text += (f"; step time {ms(before)} -> measured {ms(step) if step else '-'}, predicted "
                     f"{ms(predicted)} ({verdict(before, step, predicted)})")
    if run.name != suggestion.base_run:
        text += f"\nside by side: %dist_compare {quoted(suggestion.base_run)} {quoted(run.name)}"
    return text


def verdict(before: float, after: float | None, predicted: float) -> str:
    """"as predicted": at least half the predicted change, the predicted way (a bubble that fell 1 point
    of the 20 predicted is not what was promised); less than half: how much; else "not as predicted"."""
    expected = predicted - before
    change = None if after is None else after - before
    if change is None or change * expected <= 0:
        return "as predicted" if change == expected == 0 else "not as predicted"
    if change / expected >= 0.5:
        return "as predicted"
    return f"the predicted way, {change / expected:.0%} of the predicted change"
