"""``--memory-timeline``: one rank's tensor memory over a cell, by category (engine side).

torch.profiler's memory profile sees every tensor allocated and freed while
it records and works out what each one was (parameter, gradient, optimizer
state, activation, temporary ...) from the autograd graph and the modules and
optimizers the Python tracer saw. That works on CPU and CUDA tensors alike,
so the timeline does too. On CUDA ranks the caching allocator's own history
(``torch.cuda.memory._record_memory_history``) is recorded as well, and its
snapshot written next to the timeline for pytorch.org/memory_viz.

Opt-in: under the profiler with its Python tracer a step takes about x1.2-1.3
as long here (up to x2.5; benchmarks/plan_accuracy.py prints it), and working
out the categories afterwards takes about as long as the cell ran.
"""
from __future__ import annotations

import json
import os
import time

import torch

from ..metrics import MemoryTimeline

MAX_POINTS = 400  # per rank: enough for a plot, small enough to send to the kernel
HISTORY_ENTRIES = 200_000  # allocator-history ring buffer (CUDA), several KB each


class TimelineRecorder:
    def __init__(self, rank: int, device: torch.device, export_dir: str | None = None):
        self.rank, self.device, self.export_dir = rank, device, export_dir
        self._prof = None
        self.t0 = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        # the memory profile needs shapes and the Python tracer to tell parameters and optimizer state apart
        self._prof = profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True)
        self.t0 = time.time()
        self._prof.start()

    def stop(self) -> MemoryTimeline:
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        prof, self._prof = self._prof, None
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
            times, sizes = timeline._coalesce_timeline(device)  # microseconds; sizes[i][0] is unused
            names, rows = categories(), [row[1:] for row in sizes]
        except Exception as e:  # torch's data-flow analysis asserts on some wrappers (FSDP2's, torch 2.13)
            note = (f"torch's memory profiler could not categorise this run ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:80]}); uncategorised: the bytes the cell allocated and still "
                    "held, at each allocation and free")
            times, rows = _allocator_totals(prof, self.device)
            names = ["uncategorised"]
        if self.export_dir:  # torch's memory-timeline JSON: [times in us, [[0, bytes by category...]]]
            files.insert(0, self._path("memory_timeline.json"))
            with open(files[0], "w") as f:
                json.dump([times, [[0] + list(r) for r in rows]], f)
        times_s, columns = _downsample(times, rows, len(names))
        return MemoryTimeline(rank=self.rank, device=device, t0=self.t0, times=times_s, categories=names,
                              bytes=columns, files=files, events=len(times), note=note)

    def _path(self, suffix: str) -> str:
        os.makedirs(self.export_dir, exist_ok=True)
        return os.path.join(os.path.abspath(self.export_dir), f"rank{self.rank}_{suffix}")


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
    measured peak by up to their size from one identical run to the next.
    """
    from torch._C._profiler import _EventType

    events = [e for root in prof.profiler.kineto_results.experimental_event_tree() for e in _walk(root)
              if e.tag == _EventType.Allocation and e.extra_fields.device.type == device.type]
    events.sort(key=lambda e: e.start_time_ns)
    live: dict = {}  # address -> bytes, for the blocks allocated while recording
    held, times, rows = 0, [], []
    for e in events:
        f = e.extra_fields
        if f.alloc_size > 0:
            live[f.ptr] = f.alloc_size
            held += f.alloc_size
        elif f.ptr in live:
            held -= live.pop(f.ptr)
        else:
            continue  # a block from before the cell
        times.append(e.start_time_ns // 1000)
        rows.append([held])
    return times, rows


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
