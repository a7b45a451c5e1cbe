"""Figures derived from one run's records (pure functions; kernel and widgets use them).

Step k spans from step k-1's marker to step k's marker on the same rank;
step 1 (which also holds model set-up) is left out of means. Collectives
belong to the step during which they were issued. "comm time" is busy
time: the union of the collectives' in-flight intervals (issue to
completion) within the step, so async collectives that overlap each other
(ZeRO-3's prefetched all-gathers) count once, never summed; ``comm_summed_s``
keeps the plain sum for comparison. "exposed" is the part the rank's
training thread was blocked on: blocking collectives for all of their call,
async ones only while waited (CommWait records) and in flight, as a union
again: a wait that returns after the completer thread saw the collective done
was blocked on the GIL hand-off, not on communication, so exposed <= busy. A step with
an async collective nobody was seen waiting for (DDP's reducer waits on its
futures in C++) has exposed time None (not measured), never 0. Device clocks
(CUDA events) time the device, not the host's blocking: None as well.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from .metrics import LEDGER_CATEGORIES, RunRecords


def step_table(run: RunRecords, rank: int = 0) -> list[dict]:
    """Per step (2..N) on ``rank``: duration, comm seconds, comm bytes by op, collective count."""
    marks = sorted((m for m in run.steps if m.rank == rank), key=lambda m: m.step)
    comms = defaultdict(list)
    for c in run.comms:
        if c.rank == rank:
            comms[c.step + 1].append(c)  # issued after c.step steps: part of step c.step + 1
    waits = defaultdict(list)
    for w in run.waits:
        if w.rank == rank:
            waits[w.seq].append(w)
    rows = []
    for prev, cur in zip(marks, marks[1:]):
        cs = comms.get(cur.step, [])
        by_op = defaultdict(int)
        for c in cs:
            by_op[c.op] += c.size_bytes
        duration = cur.t - prev.t
        comm_s = busy_seconds([(c.t_issue, c.t_issue + c.seconds) for c in cs], prev.t, cur.t)
        exposed = exposed_seconds(cs, waits, prev.t, cur.t)
        rows.append({"step": cur.step, "seconds": duration, "comm_s": comm_s, "exposed_s": exposed,
                     # each op's own blocked time (a union per op: ops blocked on at once would count twice)
                     "exposed_by_op": None if exposed is None else {
                         op: exposed_seconds([c for c in cs if c.op == op], waits, prev.t, cur.t) for op in by_op},
                     "comm_summed_s": sum(c.seconds for c in cs),
                     "compute_s": max(0.0, duration - comm_s), "bytes_by_op": dict(by_op),
                     "bus_bytes": sum(c.bus_bytes for c in cs), "count": len(cs),
                     "count_by_op": {op: sum(1 for c in cs if c.op == op) for op in by_op}})
    return rows


def exposed_seconds(comms, waits: dict, lo: float, hi: float) -> float | None:
    """Seconds of [lo, hi] the thread was blocked on ``comms`` (see the module docstring), or None."""
    if any(c.clock != "wall" or (c.asynchronous and c.seq not in waits) for c in comms):
        return None
    blocked = [(c.t_issue, c.t_issue + c.seconds) for c in comms if not c.asynchronous]
    blocked += [(max(w.t, c.t_issue), min(w.t + w.seconds, c.t_issue + c.seconds))
                for c in comms if c.asynchronous for w in waits[c.seq]]  # waited while in flight
    return busy_seconds(blocked, lo, hi)


def busy_seconds(intervals, lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of (start, end) intervals, clipped to [lo, hi]: overlaps count once."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def straggler_spread(run: RunRecords) -> list[tuple[int, str, float]]:
    """(seq, op, seconds between the first and last rank entering it) for collectives seen on every rank."""
    by_seq = defaultdict(dict)
    for c in run.comms:
        by_seq[c.seq][c.rank] = c
    out = []
    for seq in sorted(by_seq):
        recs = by_seq[seq]
        if len(recs) == run.world_size and len({r.op for r in recs.values()}) == 1:
            ts = [r.t_issue for r in recs.values()]
            out.append((seq, next(iter(recs.values())).op, max(ts) - min(ts)))
    return out


def peak_ledger(run: RunRecords, rank: int) -> dict:
    """The step sample with the largest model-state total on ``rank`` (categories in bytes)."""
    best = {}
    for m in run.memory:
        if m.rank == rank and m.ledger:
            if sum(m.ledger.get(c, 0) for c in LEDGER_CATEGORIES) >= sum(best.get(c, 0) for c in LEDGER_CATEGORIES):
                best = m.ledger
    return {c: best.get(c, 0) for c in LEDGER_CATEGORIES}


def peak_rss(run: RunRecords, rank: int) -> int:
    return max((m.peak_rss or m.rss for m in run.memory if m.rank == rank), default=0)


def steady_steps(run: RunRecords, rank: int = 0) -> list[dict]:
    """``step_table`` without the steps in which torch.compile compiled (--compile), unless that is all;
    after a --memory-timeline that stopped following the cell (--timeline-steps), only the steps after
    it where there are 2 or more (the profiler's bookkeeping had made a step x1.1-2.5 as long)."""
    compiled = {int(step) for step, _ in run.description.compile}
    table = step_table(run, rank)
    kept = [s for s in table if s["step"] not in compiled] or table
    later = [s for s in kept if s["step"] > _timeline_through(run)]
    return later if len(later) >= 2 else kept


def _timeline_through(run: RunRecords) -> float:
    """The last optimizer step a --memory-timeline's profiler followed (0 without one; inf: all)."""
    if run.description.spec.get("memory_timeline") is None:
        return 0
    return max((t.steps for t in run.timelines), default=0) or float("inf")


def steady_span(run: RunRecords) -> str:
    """Which steps ``steady_steps`` times, in words ("steps 2..N", or the ones after a timeline)."""
    steps = steady_steps(run)
    first = min((s["step"] for s in steps), default=2)
    return f"steps {first}..N, after the memory timeline's" if first - 1 == _timeline_through(run) else "steps 2..N"


def steps_hold_timeline(run: RunRecords) -> bool:
    """Whether ``run``'s step figures (``steady_steps``) hold a --memory-timeline's bookkeeping."""
    return any(s["step"] <= _timeline_through(run) for s in steady_steps(run))


def schedule_idle(run: RunRecords, rank: int = 0) -> dict[int, float]:
    """Per optimizer step of a pipeline run, the seconds ``rank``'s schedule spent outside its stage's
    forward and backward (waits for the neighbouring stages, sends, receives, the schedule's own work)."""
    idle: dict[int, float] = defaultdict(float)
    for p in run.pipeline:
        if p.rank == rank:
            idle[p.step] += p.idle_s
    return dict(idle)


def summary(run: RunRecords) -> dict:
    """The comparison row for a run (rank 0 for per-step figures, all ranks for memory).

    Under --compile, ``compile_s`` is the seconds torch.compile spent, and steps in which it
    compiled are left out of the per-step figures (step 1 always is: step_table starts at 2).
    """
    steps = steady_steps(run)
    ranks = range(run.world_size)
    ledgers = {r: peak_ledger(run, r) for r in ranks}
    ops = sorted({op for s in steps for op in s["bytes_by_op"]})
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    losses = [s for s in run.scalars if s.rank == 0 and "loss" in s.values]
    return {
        "name": run.name,
        "strategy": run.strategy,
        "steps": max((m.step for m in run.steps if m.rank == 0), default=0),
        "model_state_bytes": {r: sum(led.values()) for r, led in ledgers.items()},
        "ledger": ledgers,
        "peak_rss": {r: peak_rss(run, r) for r in ranks},
        "comm_bytes_per_step": {op: mean([s["bytes_by_op"].get(op, 0) for s in steps]) for op in ops},
        "bus_bytes_per_step": mean([s["bus_bytes"] for s in steps]),
        "collectives_per_step": {op: mean([s["count_by_op"].get(op, 0) for s in steps]) for op in ops},
        "step_s": mean([s["seconds"] for s in steps]),
        "comm_s_per_step": mean([s["comm_s"] for s in steps]),
        "exposed_s_per_step": (mean([s["exposed_s"] for s in steps])
                               if steps and all(s["exposed_s"] is not None for s in steps) else None),
        "final_loss": losses[-1].values["loss"] if losses else None,
        "compile_s": sum(seconds for _, seconds in run.description.compile),
    }


def bubble_table(run: RunRecords) -> list[dict]:
    """Per rank of a pipeline run: its stage, the mean span of a pipeline step, its compute
    seconds, and the idle (bubble) fraction measured, next to theory's (p-1)/(M+p-1).

    A step's span runs from the first rank entering the schedule to the last one leaving it
    (ranks share the host clock): theory's window. A stage's own schedule call misses part of
    its idle time (the last stage is done while the first still runs its last backward).
    Step 1 (shape inference, warm-up) is left out when there are later steps.
    """
    spans: dict = defaultdict(lambda: [float("inf"), float("-inf")])
    for p in run.pipeline:
        span = spans[p.step]
        span[0], span[1] = min(span[0], p.t - p.step_s), max(span[1], p.t)
    by_rank = defaultdict(list)
    for p in run.pipeline:
        by_rank[p.rank].append(p)
    rows = []
    for rank in sorted(by_rank):
        recs = by_rank[rank]
        later = [p for p in recs if p.step > 1] or recs
        window = statistics.fmean(spans[p.step][1] - spans[p.step][0] for p in later)
        compute_s = statistics.fmean(p.compute_s for p in later)
        idle = max(0.0, window - compute_s)
        rows.append({"rank": rank, "stage": recs[0].stage, "stages": recs[0].stages,
                     "microbatches": recs[0].microbatches, "schedule": recs[0].schedule,
                     "step_s": window, "compute_s": compute_s, "idle_s": idle,
                     "bubble": idle / window if window else 0.0, "theory": recs[0].bubble_theory})
    return rows


def outside_allocator(samples) -> dict[int, int]:
    """{rank: driver bytes minus the allocator's reserved bytes} from each rank's latest sample that
    has both (the memory PyTorch's allocator does not see)."""
    out = {}
    for s in samples:
        if s.driver_used is not None and s.cuda_reserved is not None:
            out[s.rank] = s.driver_used - s.cuda_reserved
    return out


def step_peak_points(run: RunRecords, t) -> dict[int, int]:
    """{step: index into ``t``'s points of its highest total} for timeline ``t`` of a
    ``--memory-timeline`` run, a step running from the previous optimizer step's end to its own
    (step 1 from the cell's start: the set-up and the optimizer's first state)."""
    ends = sorted((m.t, m.step) for m in run.steps if m.rank == t.rank)
    totals = t.totals()
    out = {}
    for (a, _), (b, step) in zip([(float("-inf"), 0)] + ends, ends):
        inside = [j for j, x in enumerate(t.times) if a < t.t0 + x <= b]
        if inside:
            out[step] = max(inside, key=totals.__getitem__)
    return out


def step_peaks(run: RunRecords) -> dict[int, dict[int, int]]:
    """{rank: {step: the peak of tracked tensor bytes within it}} for steps 2..N of a
    ``--memory-timeline`` run (step 1 holds the set-up and the optimizer's first state, so it is
    left out; see step_peak_points)."""
    out = {}
    for t in run.timelines:
        totals = t.totals()
        first = min((m.step for m in run.steps if m.rank == t.rank), default=None)
        out[t.rank] = {step: totals[j] for step, j in step_peak_points(run, t).items() if step != first}
    return out


def busiest_timeline(run: RunRecords):
    """The ``--memory-timeline`` of the rank whose tracked tensors peaked highest, or None."""
    return max(run.timelines, key=lambda t: max(t.totals(), default=0), default=None)


def peak_step(run: RunRecords) -> int | None:
    """The optimizer step during which the highest timeline peaked (1: up to the first step's end,
    set-up included); None when it peaked after the last step, or without a timeline."""
    t = busiest_timeline(run)
    if t is None:
        return None
    when, _ = t.peak()
    for end, step in sorted((m.t, m.step) for m in run.steps if m.rank == t.rank):
        if t.t0 + when <= end:
            return step
    return None


def timeline_lines(run: RunRecords) -> list[str]:
    """One line per rank of a ``--memory-timeline`` run: the peak of tracked tensor bytes, when, and
    by category (largest first), then the files written."""
    from .metrics import format_bytes

    lines = []
    by_step = step_peaks(run)
    for t in sorted(run.timelines, key=lambda t: t.rank):
        when, parts = t.peak()
        cats = ", ".join(f"{c} {format_bytes(b)}" for c, b in sorted(parts.items(), key=lambda kv: -kv[1]) if b)
        lines.append(f"rank {t.rank} ({t.device}): peak {format_bytes(sum(parts.values()))} at {when:.2f} s "
                     f"({cats or 'nothing tracked'}); {t.events} memory events")
        if len(peaks := by_step.get(t.rank, {})) >= 2:
            worst = max(peaks, key=peaks.get)
            lines.append(f"  steps 2..N peak at {format_bytes(statistics.median(peaks.values()))} (median), "
                         f"{format_bytes(peaks[worst])} at most (step {worst})")
        lines += [f"  {t.note}"] * bool(t.note) + [f"  wrote {f}" for f in t.files]
    return lines
