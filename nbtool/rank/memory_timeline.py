"""``--memory-timeline``: one rank's tensor memory over a cell, by category (engine side).

torch.profiler's memory profile sees every tensor allocated and freed while
it records and works out what each one was (parameter, gradient, optimizer
state, activation, temporary ...) from the autograd graph and the modules and
optimizers the Python tracer saw. That works on CPU and CUDA tensors alike,
so the timeline does too. On CUDA ranks the caching allocator's own history
(``torch.cuda.memory._record_memory_history``) is recorded as well, and its
snapshot written next to the timeline for pytorch.org/memory_viz.

The profiler records no free made on a thread it does not follow, and gloo's
workers let go there of what a collective or a send held: such blocks are
taken as freed when their work ended (``_free_times``), else a timeline on CPU
ranks creeps up by each step's collective buffers.

Opt-in: under the profiler with its Python tracer a step takes about x1.2-1.3
as long here (up to x2.5; benchmarks/plan_accuracy.py prints it), and working
out the categories afterwards takes about as long as the cell ran.

That analysis needs host memory while it runs, in proportion to what was
recorded: torch materialises every op, allocation and Python call of the
cell (here 25 MB a step for the tutorial model on one process, 0.5 GB a step
a rank under fsdp --tp 2 --pp 2, whose DTensor dispatch runs many more).
So it records the cell's first ``--timeline-steps`` optimizer steps and then
stops following ops and Python calls (``TimelineRecorder.on_step``). Where
the host may not hold every rank's at once, its ranks take turns
(nbtool.rank.host_turns: 8 ranks of that run had the OOM killer take one on
a 24 GB host), and each gives the memory back to the system when done
(glibc's ``malloc_trim``; without it an engine kept 0.8-3 GB after the cell).
"""
from __future__ import annotations

import json
import os
import time

import torch

from ..metrics import MemoryTimeline
from .bootstrap import rss

MAX_POINTS = 400  # per rank: enough for a plot, small enough to send to the kernel
HISTORY_ENTRIES = 200_000  # allocator-history ring buffer (CUDA), several KB each


_cells = 0  # timelines this process started: the same count on every rank, so it names a cell's analysis
# the analysis's RSS growth over the recording's (the cell's growth while it ran, its model included):
# measured 5x (the tutorial model, one process), 16x (fsdp --tp 2 on 2 ranks, fsdp --tp 2 --pp 2 on 8);
# a guess, so that ranks whose host plainly holds them all do not take turns
ANALYSIS_OVER_RECORDING = 25


class TimelineRecorder:
    def __init__(self, rank: int, device: torch.device, export_dir: str | None = None, ranks_on_host: int = 1,
                 steps: int | None = None):
        global _cells
        _cells += 1
        self.rank, self.device, self.export_dir, self.ranks_on_host = rank, device, export_dir, ranks_on_host
        self.phase = f"{os.environ.get('MASTER_ADDR', '')}-{os.environ.get('MASTER_PORT', '')}-{_cells}"
        self._prof = None
        self.t0 = 0.0
        self.steps = steps  # record up to the end of this optimizer step (None: the whole cell)
        self.steps_run = 0
        self.cut_us = None  # the wall clock (us, the profiler's) when it stopped following ops

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        # the memory profile needs shapes and the Python tracer to tell parameters and optimizer state apart
        self._prof = profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True)
        self._activities = activities
        self.t0, self._rss0 = time.time(), rss()[0]
        self._prof.start()

    def on_step(self, step: int) -> None:
        """An optimizer step ended: at the last one to record, stop following ops.

        Not ``prof.stop()``: that materialises what was recorded, inside training (54 s a rank under
        fsdp --tp 2 --pp 2 on 8 ranks, past the others' collective timeout). Toggling the activities
        off stops torch's ops but not its Python tracer (torch 2.13: FSDP2's Python calls were 95% of
        the events of later steps), so this thread's profile function goes too. The profiler still
        logs each allocation, but later steps run at nearly full speed, and without ops their new
        tensors have no category: where more steps follow, the timeline ends here (``cut``)."""
        import sys

        self.steps_run = step
        if step == self.steps and self._prof is not None:
            self._prof.toggle_collection_dynamic(False, self._activities)
            sys.setprofile(None)  # the tracer's own stop() later clears what is left
            self.cut_us = time.time() * 1e6

    @property
    def cut(self) -> bool:
        """Whether the cell ran steps past the recorded ones (a cell that ended with step N is kept
        whole: what it did after step N is only the end of the cell, its new tensors "unknown")."""
        return self.cut_us is not None and self.steps_run > self.steps

    def stop(self) -> MemoryTimeline:
        """Stop recording and work out the timeline, in this rank's turn among its host's (host_turns)."""
        import gc

        from .host_turns import host_turns

        prof, self._prof = self._prof, None
        guess = ANALYSIS_OVER_RECORDING * max(rss()[0] - self._rss0, 1 << 20)
        with host_turns(f"timeline-{self.phase}", self.ranks_on_host, guess) as turn:
            record = self._analyse(prof)
            turn.at_height()
            del prof
            gc.collect()
            _give_back_memory()
        if turn.waited_s > 1:
            said = f"analysed in turns with this host's other ranks (waited {turn.waited_s:.0f} s)"
            record.note = f"{record.note}; {said}" if record.note else said
        return record

    def _analyse(self, prof) -> MemoryTimeline:
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        prof.stop()
        files = []
        if self.device.type == "cuda":
            if self.export_dir:
                files.append(self._path("snapshot.pickle"))
                torch.cuda.memory._dump_snapshot(files[-1])
            torch.cuda.memory._record_memory_history(enabled=None)
        device = str(self.device) if self.device.type == "cpu" else f"cuda:{self.device.index or 0}"
        note = ""
        try:
            timeline = MemoryProfileTimeline(prof._memory_profile())
            timeline.timeline = _with_unseen_frees(timeline.timeline, prof, self.device)
            times, sizes = timeline._coalesce_timeline(device)  # microseconds; sizes[i][0] is unused
            names, rows = categories(), [row[1:] for row in sizes]
        except Exception as e:  # torch's data-flow analysis asserts on some wrappers (FSDP2's, torch 2.13)
            note = (f"torch's memory profiler could not categorise this run ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:80]}); uncategorised: the bytes the cell allocated and still "
                    "held, at each allocation and free")
            times, rows = _allocator_totals(prof, self.device)
            names = ["uncategorised"]
        if self.cut:  # what came after step N is left out: its new tensors have no category
            kept = sum(1 for t in times if t <= self.cut_us)
            times, rows = times[:kept], rows[:kept]
            said = (f"recorded up to the end of optimizer step {self.steps} of the {self.steps_run} the cell ran "
                    "(--timeline-steps N records more; the later steps ran without the profiler's bookkeeping)")
            note = f"{note}; {said}" if note else said
        if self.export_dir:  # torch's memory-timeline JSON: [times in us, [[0, bytes by category...]]]
            files.insert(0, self._path("memory_timeline.json"))
            with open(files[0], "w") as f:
                json.dump([times, [[0] + list(r) for r in rows]], f)
        times_s, columns = _downsample(times, rows, len(names))
        # the profiler's clock is the wall clock (us); its first event comes up to a second after start()
        t0 = times[0] / 1e6 if times and times[0] > 0 else self.t0
        return MemoryTimeline(rank=self.rank, device=device, t0=t0, times=times_s, categories=names,
                              bytes=columns, files=files, events=len(times), note=note,
                              steps=self.steps if self.cut else 0)

    def _path(self, suffix: str) -> str:
        os.makedirs(self.export_dir, exist_ok=True)
        return os.path.join(os.path.abspath(self.export_dir), f"rank{self.rank}_{suffix}")


def _give_back_memory() -> None:
    """Return freed heap to the system (glibc): the analysis's GBs otherwise stay in the engine's RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory stays with the process for its next use
        pass


def categories() -> list[str]:
    """The profiler's categories in the order of its sizes columns (None: "unknown")."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    order = sorted(_CATEGORY_TO_INDEX, key=_CATEGORY_TO_INDEX.get)
    return [c.name.lower() if c is not None else "unknown" for c in order]


def _allocator_totals(prof, device) -> tuple[list, list]:
    """(times in us, [[bytes]]) from the profiler's allocation events on ``device``: the bytes allocated
    while it recorded and not yet freed, after each allocation or free.

    Frees of blocks allocated before the cell (the previous cell's model and optimizer state, let go
    when the cell rebinds their names, or whenever the garbage collector reaches FSDP2's reference
    cycles) are not counted: subtracted from the allocator's running total, they had moved the
    measured peak by up to their size from one identical run to the next. Frees the profiler did
    not see: ``_free_times``.
    """
    allocs, freed, _ = _free_times(prof, device)
    steps = []  # (ns, bytes allocated or freed)
    for e in allocs:
        size = e.extra_fields.alloc_size
        steps.append((e.start_time_ns, size))
        if id(e) in freed:
            steps.append((freed[id(e)], -size))
    steps.sort()
    held, times, rows = 0, [], []
    for ns, delta in steps:
        held += delta
        times.append(ns // 1000)
        rows.append([held])
    return times, rows


def _free_times(prof, device) -> tuple[list, dict, list]:
    """(the allocations on ``device`` while recording, id(allocation) -> ns when it was freed, [(ns, bytes)
    of each free of a block allocated before recording]).

    The profiler records no free made on a thread it does not follow, and the backend's worker lets
    go of what a collective or a send held once the work is done: gloo's copies made inside a
    collective (a reduce-scatter's input, a gather's staging) and the activations a pipeline stage
    sends on had looked held until the cell ended, and the total crept up by each step's buffers
    (fsdp's peak by a third over 6 steps, a pipeline's by an activation per step, on CPU ranks). A
    block whose free was not recorded is taken as freed:

    - made inside a collective: when the last work that used it ended (the worker's ``gloo:*``
      events list their tensors);
    - sent (a send's input), or only ever broadcast or scattered from (the source rank's flat copy
      in DDP's start-up broadcast of the parameters; the contiguous chunks DTensor scatters when it
      shards a weight over tp: blocks of 8 KiB had stayed in a tp x pp run's peak, up to 34 KiB
      or +7.5%, as their addresses were or were not handed out again), and held by no Python
      tensor now (the cell is over): when the last send, broadcast or scatter of it ended;
    - made inside a functional collective (``_c10d_functional::*``: tensor parallelism's DTensor
      all-reduces clone their input into the result, which the worker may let go of last), or only
      ever all-gathered into or reduce-scattered (FSDP2's flat all-gather output, read by its
      copy-out after the wait): when the last op that read it ended (the consumer after the wait),
      if no Python tensor holds it now (a tp run's peak had held 1-6 of them, a different number
      each run; a 16-step fsdp run's end 19-260 kB of all-gather outputs);
    - a flat copy made for one all-reduce, one of a series (``_flat_copies``), if no Python tensor
      holds it now: when the last op that read it ended;
    - else when its address was handed out again (it was free by then); else it is held to the end.
    Persistent buffers that collectives use (DDP's buckets, FSDP's shards) are neither.

    Each use of a tensor is the allocation last made at its address before the use: the profiler
    gives the next block at an address the same allocation id when it missed the free, and keyed by
    that id a gloo copy had taken on the next block's reads (a step's peak a whole FSDP unit high,
    7 MB on the wide shape, in one run in two; held 0.1-0.6 s past its work).
    """
    import bisect

    from torch._C._profiler import _EventType

    every = [e for root in prof.profiler.kineto_results.experimental_event_tree() for e in _walk(root)]
    events = sorted((e for e in every if e.tag == _EventType.Allocation and e.extra_fields.device.type == device.type),
                    key=lambda e: e.start_time_ns)
    made: dict = {}  # address -> the allocations there while recording, in time order
    for e in events:
        if e.extra_fields.alloc_size > 0:
            made.setdefault(e.extra_fields.ptr, []).append(e)
    starts = {ptr: [e.start_time_ns for e in blocks] for ptr, blocks in made.items()}

    def block(t, when):  # id of the allocation a profiled tensor at ``when`` is, None if from before
        i = bisect.bisect_right(starts.get(t.storage_data_ptr, ()), when) - 1
        return id(made[t.storage_data_ptr][i]) if i >= 0 else None

    works = [e for e in every if e.tag == _EventType.TorchOp and _name(e).startswith(("gloo:", "c10d::"))]
    used_until, uses = {}, {}  # id(allocation) -> when the last work using it ended, its ops
    reads = {}  # id(allocation) -> [(start, name)] of the worker's collectives that read it
    for w in works:
        for t in _tensors(w.extra_fields.inputs):
            if (b := block(t, w.start_time_ns)) is not None:
                used_until[b] = max(used_until.get(b, 0), w.end_time_ns)
                uses.setdefault(b, set()).add(_name(w))
                if _name(w).startswith("gloo:"):  # the worker's event (c10d's on the caller is the same call)
                    reads.setdefault(b, []).append((w.start_time_ns, _name(w)))
    # handed to the backend: sent, or only ever broadcast or scattered from (DDP's start-up broadcast of
    # a flat copy of the parameters, DTensor's contiguous chunks of a weight it shards over tp), whose
    # last reference the source rank's gloo worker drops
    sent = {b for b, ops in uses.items() if any("send" in op for op in ops) or all(_handed_out(op) for op in ops)}
    # FSDP's flat buffers; DDP's buckets, which only C++ holds and which outlive the cell, are all-reduced
    sharding = {b for b, ops in uses.items() if all("gather" in op or "reduce_scatter" in op for op in ops)}
    copies = _flat_copies(reads, {id(e): e for e in events if e.extra_fields.alloc_size > 0})
    ends = {id(w): w.end_time_ns for w in works}
    functional = {id(e): e.end_time_ns for e in every if e.tag == _EventType.TorchOp  # as ``ends``, for
                  and _name(e).startswith("_c10d_functional::") and "wait" not in _name(e)}  # _collective_of
    alive = _python_tensor_addresses() if sent or functional or sharding or copies else frozenset()  # walks every object
    held = {id(made[ptr][-1]) for ptr in alive if ptr in made}  # what Python holds now: the last block there
    allocs, freed, unseen, live, earlier = [], {}, {}, {}, []  # live: address -> its allocation not yet freed
    results, last_read = set(), {}  # read after the collective: id(allocation), when the last read ended
    for e in events:
        f = e.extra_fields
        if f.alloc_size > 0:
            before = live.get(f.ptr)
            if before is not None:  # its free went unseen: by now at the latest
                unseen[id(before)] = min(unseen.get(id(before), e.start_time_ns), e.start_time_ns)
            live[f.ptr] = e
            allocs.append(e)
            owner = _collective_of(e, ends)
            if owner is not None:
                unseen[id(e)] = max(owner, used_until.get(id(e), 0))
            elif id(e) in sent and id(e) not in held:
                unseen[id(e)] = used_until[id(e)]
            elif id(e) not in held and (id(e) in sharding or id(e) in copies
                                        or _collective_of(e, functional) is not None):
                results.add(id(e))
        elif f.ptr in live:
            freed[id(live.pop(f.ptr))] = e.start_time_ns
        else:
            earlier.append((e.start_time_ns, -f.alloc_size))
    if results:  # a collective's result: taken as freed when the last op reading it ended
        for op in every:
            if op.tag == _EventType.TorchOp:
                for t in _tensors(op.extra_fields.inputs):
                    if (b := block(t, op.start_time_ns)) in results:
                        last_read[b] = max(last_read.get(b, 0), op.end_time_ns)
    for e in allocs:
        taken = [t for t in (unseen.get(id(e)), last_read.get(id(e))) if t is not None]
        if id(e) not in freed and taken:
            freed[id(e)] = min(taken)
    return allocs, freed, earlier


def _flat_copies(reads: dict, allocation: dict) -> set:
    """The blocks only ever all-reduced, by one collective each, in a series of the same size where a
    new block was made by ``torch.cat`` after an earlier one's reduction: the flat copy made for
    each reduction (DeepSpeed ZeRO-1/2's flattened gradient buckets on gloo). Whether the training
    thread or gloo's worker drops such a copy last is a race, and the worker's free goes unrecorded:
    0-2 earlier steps' copies had looked held at a later step's peak (the tutorial model's zero2
    +7% or +14%, a different number each run), and the last step's at its optimizer step (wide
    shape, bucket 15 MiB: one rank's peak 8-11% over the other's, one run in two). DDP's buckets,
    all-reduced again each step, are made by the reducer, not by ``torch.cat`` (in a 2-step run,
    the buckets DDP rebuilds in step 2 are reduced once, after step 1's). ``reads``: id(allocation)
    -> [(start, name)] of the worker's collectives that read it."""
    once = {b: r[0][0] for b, r in reads.items()
            if len(r) == 1 and r[0][1] == "gloo:all_reduce" and _made_by(allocation[b], "aten::cat")}
    series: dict = {}  # size -> [(made, reduced)] of the once-reduced blocks of that size
    for b, reduced in once.items():
        e = allocation[b]
        series.setdefault(e.extra_fields.alloc_size, []).append((e.start_time_ns, reduced))
    out = set()
    for b, reduced in once.items():
        made = allocation[b].start_time_ns
        others = series[allocation[b].extra_fields.alloc_size]
        if any(m > reduced for m, _ in others) or any(r < made for _, r in others):
            out.add(b)
    return out


def _python_tensor_addresses() -> frozenset:
    """The storage addresses of every tensor Python holds now (a DTensor's local shard included)."""
    import gc

    out = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                out.add(obj.untyped_storage().data_ptr())
            except Exception:  # meta, fake or subclass tensors without a storage of their own
                pass
    return frozenset(out)


def _tensors(inputs):
    """The tensors among a profiled op's inputs (lists of tensors included)."""
    for i in inputs:
        if hasattr(i, "storage_data_ptr"):
            yield i
        elif isinstance(i, list):
            yield from (t for t in i if hasattr(t, "storage_data_ptr"))


def _with_unseen_frees(timeline: tuple, prof, device) -> tuple:
    """torch's categorised timeline plus a DESTROY for each tensor whose free it did not see
    (``_free_times``), at the time taken for it; less the blocks allocated before the cell that no op
    of the cell used and that it saw freed. torch counts those ("unknown") from the cell's start to
    their free: the previous cell's model and optimizer state, let go when the cell rebinds their names
    or the garbage collector gets to them, had put a ddp run's peak at 5x its steps' (82 MiB, 69 of
    them a previous cell's, freed during step 1). Tensors from before that the cell uses (a model
    built in an earlier cell) stay: torch knows them as tensors."""
    from collections import Counter

    from torch.profiler._memory_profiler import Action, TensorKey

    allocs, freed, earlier = _free_times(prof, device)
    frees, sizes = Counter(earlier), Counter(size for _, size in earlier)
    kept = []
    for entry in timeline:
        t, action, (key, _), size = entry
        # each such free: torch's DESTROY, and its PREEXISTING entry counting the block from the start
        if not isinstance(key, TensorKey) and action == Action.PREEXISTING and sizes[size] > 0:
            sizes[size] -= 1
        elif not isinstance(key, TensorKey) and action == Action.DESTROY and frees[(t, size)] > 0:
            frees[(t, size)] -= 1
        else:
            kept.append(entry)
    timeline = tuple(kept)
    # torch keys a tensor by its allocation id, which the profiler repeats for the next block at an
    # address when it missed a free: one key can stand for several blocks, of which torch destroys
    # only those whose free it saw (at that free's time); each other one gets its DESTROY here (had
    # the key's later DESTROY stood for both, a DTensor all-reduce result stayed counted, in one tp
    # run in six: 128 KiB, 2.5% of a Llama's peak)
    versions, destroyed_at = {}, {}
    for t, action, (key, version), _ in timeline:
        if action == Action.DESTROY:
            destroyed_at.setdefault(key, set()).add(t)
        versions[key] = max(versions.get(key, 0), version + (action == Action.INCREMENT_VERSION))
    extra = []
    for e in allocs:
        key = TensorKey.from_allocation(e.extra_fields)
        if key is not None and key in versions and id(e) in freed and freed[id(e)] not in destroyed_at.get(key, ()):
            extra.append((freed[id(e)], Action.DESTROY, (key, versions[key]), e.extra_fields.alloc_size))
    return tuple(sorted(timeline + tuple(extra), key=lambda x: (x[0], x[1].value)))


def _handed_out(op: str) -> bool:
    """A collective whose input the source rank hands to the backend whole: a broadcast or a scatter
    (not a reduce-scatter, whose input the worker copies: ``_collective_of``)."""
    return "broadcast" in op or op in ("gloo:scatter", "c10d::scatter_")


def _name(event) -> str:
    try:
        return event.name
    except UnicodeDecodeError:  # seen on torch 2.13: a garbled name of some Python-tracer event
        return ""


def _made_by(alloc, op: str) -> bool:
    """Whether ``op`` (or an op inside it) made the allocation."""
    parent = alloc.parent
    while parent is not None:
        if _name(parent) == op:
            return True
        parent = parent.parent
    return False


def _collective_of(alloc, ends: dict):
    """The end (ns) of the collective an allocation was made in, or None."""
    parent = alloc.parent
    while parent is not None:
        if id(parent) in ends:
            return ends[id(parent)]
        parent = parent.parent
    return None


def _walk(event):
    yield event
    for child in event.children:
        yield from _walk(child)


def _downsample(times: list, rows: list, width: int) -> tuple[list, list]:
    """At most MAX_POINTS points: in each equal slice of the events keep the one with the highest
    total, so the peak is never averaged away. Returns (seconds since the first event, per-category
    columns)."""
    if not times:
        return [], [[] for _ in range(width)]
    n, m = len(times), min(len(times), MAX_POINTS)
    keep = [max(range(k * n // m, (k + 1) * n // m), key=lambda i: sum(rows[i])) for k in range(m)]
    if keep[-1] != n - 1:
        keep.append(n - 1)  # the end of the cell: what stays allocated afterwards
    return [(times[i] - times[0]) / 1e6 for i in keep], [[rows[i][c] for i in keep] for c in range(width)]
