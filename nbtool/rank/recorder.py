"""Recording a rank's collectives, memory, steps and logged scalars while a cell runs.

Collectives are caught at torch.distributed's Python API, through the hang
watchdog's wrappers (installed once per engine life; ``watchdog.observe``
hands each outermost call to the active recorder, so references captured by
DeepSpeed in an earlier cell still reach this one): FSDP2, DeepSpeed and
pipelining issue theirs there, DTensor (tensor and sequence parallelism)
through the functional collectives (nbtool.rank.collective_calls), and the DDP strategy routes its bucket all-reduces through a
Python comm hook that calls ``dist.all_reduce``. (A TorchDispatchMode would
also see C++-issued collectives, but it runs Python on every aten op: about
+7% step time measured on a 3.4M-parameter model; this costs a few µs per
collective.) Only the outermost call is recorded, so deprecated wrappers that
call their replacements count once.

Times: a blocking collective is timed around the call (CUDA events on GPUs).
An async one on nccl is timed by the CUDA events NCCL records around its
kernel (``Work._get_duration()``, with the flight recorder's timing on: device
time, read by the completer thread once the work is done, so the training
thread never synchronises); elsewhere (gloo) an async one is timed from issue
until a completer thread, waiting on the work's future in issue order with the GIL
released, sees it done ("wall" clock; at most a GIL hand-off late). A
callback on the future would run on the backend's worker thread and hold it
until the training thread yields the GIL, delaying the next collectives:
measured +5.8% step time on ZeRO-3 (63 async all-gathers per step), against
0.999 with the completer thread (benchmarks/metrics_overhead.py, paired run).
Gloo's send/recv works have no future and complete only when waited, so
those are timed from issue until the caller's ``wait()`` returns.

Exposed time (how long the training thread was blocked on communication): a
blocking collective for all of its call; an async one while the thread sat in
``Work.wait()`` on it (CommWait records; ``_time_waits`` times torch's Work
class). A future waited inside C++ (DDP's reducer, on its comm hook's
futures) is never seen waiting, so run_analysis leaves such steps' exposed
time unmeasured rather than calling it zero.

A sampler thread records memory every ``interval`` seconds and, when a live
dashboard is shown (``publish``), sends new records to the kernel
(ipyparallel data messages); the complete list is returned by ``stop()``, so
nothing depends on the live path.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import weakref

import torch

from .. import protocol
from ..collectives import bandwidths, bus_factor
from ..metrics import CommRecord, CommWait, MemorySample, ScalarRecord, StepMarker
from .bootstrap import rank_device, rss
from .collective_calls import complete, describe_call, is_async


def _cublas_workspace_bytes(device) -> int | None:
    """Bytes of cuBLAS workspace inside the allocator's count, measured by releasing the workspaces
    (the next matmul takes them again, from the allocator's cache); None where torch cannot, or where
    CUDA graphs may have captured a workspace (torch.compile's cudagraph trees): released, its memory
    could go to another graph's tensors while the first still replays into it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or "torch._inductor.cudagraph_trees" in sys.modules:
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    return max(0, before - torch.cuda.memory_allocated(device))


class Recorder:
    def __init__(self, rank: int, interval: float = 0.25, publish: bool = True):
        self.rank = rank
        self.interval = interval
        self.publish = publish
        self.records: list = []
        self._published = 0
        self._batch = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step = 0
        self._peak_since = 0  # MemorySample.cuda_peak_since
        self._device = rank_device()  # the sampler thread must not fall back to cuda:0
        self._cuda = self._device.type == "cuda"
        self._pending_events: list = []
        self._async: queue.SimpleQueue = queue.SimpleQueue()  # (future, record fields, t0) of async calls
        self._completer: threading.Thread | None = None
        # id(Work) -> (seq, weak reference) of async collectives not waited for yet; an entry goes when its
        # Work is waited or freed (DDP's futures are never waited in Python), so no later Work reuses its id
        self._works: dict = {}
        self._driver = None  # nbtool.nvml.ProcessMemory on GPU ranks with nvidia-ml-py; False: none

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        from . import watchdog

        if not watchdog.installed():  # outside a bootstrapped engine
            watchdog.install(self.rank)
        watchdog.observe(self._call)
        _time_waits(self)
        self._stop.clear()  # restartable: benchmarks toggle recording between steps
        self._peak_since = 0
        if self._cuda:  # cuda_peak is this run's high-water mark, not the process's since it began
            torch.cuda.reset_peak_memory_stats(self._device)
        self._sample("interval")
        self._thread = threading.Thread(target=self._run, name="nbtool-recorder", daemon=True)
        self._thread.start()
        self._completer = threading.Thread(target=self._complete, name="nbtool-async-timer", daemon=True)
        self._completer.start()

    def stop(self) -> list:
        """Stop observing collectives and sampling; return every record of the run."""
        from . import watchdog

        watchdog.observe(None)
        _time_waits(None)
        self._works.clear()
        self._stop.set()
        self._async.put(None)
        for thread in (self._thread, self._completer):
            if thread is not None:
                thread.join(timeout=5)
        self._resolve_cuda_events(block=True)
        self._sample("interval", workspace=True)
        return list(self.records)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample("interval")
            self._resolve_cuda_events(block=False)
            self._publish()

    def _complete(self) -> None:
        """Time async collectives: wait on each one's future in issue order (the GIL is released
        while waiting), then stamp its duration from issue to when this thread saw it done."""
        while True:
            item = self._async.get()
            if item is None:
                return
            fut, base, t0, work = item
            try:
                fut.wait()
            except Exception:  # a failed collective: the cell's error reports it
                continue
            device_s = _device_seconds(work)
            clock = "cuda_event" if device_s is not None else "wall"
            self._done(base, device_s if device_s is not None else time.perf_counter() - t0, clock)
            # let go of the collective's tensors now, not when the next one is issued: held here they
            # outlived the caller's last use (more memory), and were freed on this thread, unseen by
            # the memory timeline's profiler
            del item, fut, work

    def _publish(self) -> None:
        if not self.publish:
            return
        with self._lock:
            new = self.records[self._published:]
            self._published = len(self.records)
        if not new:
            return
        try:
            from ipyparallel.datapub import publish_data

            self._batch += 1
            publish_data({protocol.records_key(self.rank, self._batch): new})
        except Exception:  # outside an engine (unit use): live updates are optional
            self.publish = False

    def _add(self, record) -> None:
        with self._lock:
            self.records.append(record)

    # -- what strategies report ------------------------------------------------
    def on_step(self, step: int, ledger=None) -> None:
        self.step = step
        self._add(StepMarker(self.rank, step, time.time()))
        self._sample("step", ledger)
        if step == 1 and self._cuda:
            # from here the allocator's peak is that of steps 2..N (what the planner predicts); the
            # sample just taken keeps the set-up's and first step's
            torch.cuda.reset_peak_memory_stats(self._device)
            self._peak_since = 1

    def on_record(self, record) -> None:
        """Any other record a strategy makes (e.g. a PipelineStep)."""
        self._add(record)

    def on_log(self, step: int, values: dict) -> None:
        self._add(ScalarRecord(self.rank, step, time.time(), dict(values)))

    # -- collectives -------------------------------------------------------------
    def _call(self, fn, name, args, kwargs):
        """Make one outermost collective call (from the watchdog's wrapper) and record it."""
        op, size, n, dtype = describe_call(name, args, kwargs)
        self._seq += 1
        seq, step = self._seq, self.step
        t_issue = time.time()
        start_ev = None
        if self._cuda:
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
        t0 = time.perf_counter()
        result = complete(name, fn(*args, **kwargs))
        asynchronous = is_async(name, kwargs)
        base = dict(rank=self.rank, seq=seq, op=op, size_bytes=size, bus_bytes=size * bus_factor(op, n),
                    group_size=n, dtype=dtype, t_issue=t_issue, step=step)
        if start_ev is not None and not asynchronous:
            end_ev = torch.cuda.Event(enable_timing=True)
            end_ev.record()
            with self._lock:
                self._pending_events.append((base, start_ev, end_ev))
        elif asynchronous and result is not None and hasattr(result, "get_future"):
            base["asynchronous"] = True
            try:
                fut = result.get_future()
            except RuntimeError:  # gloo send/recv: no future, and done only once waited
                return _TimedWork(result, lambda: self._done(base, time.perf_counter() - t0, "wall"),
                                  lambda t, s: self._add(CommWait(self.rank, seq, t, s)))
            self._works[id(result)] = (seq, weakref.ref(result, lambda _, key=id(result): self._works.pop(key, None)))
            # timed by the completer thread, not a callback on the backend's worker
            # thread: such a callback waits there for the GIL and delays the next collectives
            self._async.put((fut, base, t0, result if self._cuda else None))
        else:
            self._done(base, time.perf_counter() - t0, "wall")
        return result

    def _done(self, base: dict, seconds: float, clock: str) -> None:
        alg, bus = bandwidths(base["op"], base["size_bytes"], base["group_size"], seconds)
        self._add(CommRecord(**base, seconds=seconds, clock=clock, algbw=alg, busbw=bus))

    def _resolve_cuda_events(self, block: bool) -> None:
        with self._lock:
            pending, self._pending_events = self._pending_events, []
        left = []
        for base, start, end in pending:
            if block:
                end.synchronize()
            if end.query():
                self._done(base, start.elapsed_time(end) / 1e3, "cuda_event")
            else:
                left.append((base, start, end))
        with self._lock:
            self._pending_events[:0] = left

    # -- memory ------------------------------------------------------------------
    def _sample(self, source: str, ledger=None, workspace: bool = False) -> None:
        now_rss, peak = rss()
        sample = MemorySample(self.rank, time.time(), self.step, source, now_rss, peak)
        if self._cuda:
            sample.cuda_allocated = torch.cuda.memory_allocated(self._device)
            sample.cuda_reserved = torch.cuda.memory_reserved(self._device)
            sample.cuda_peak = torch.cuda.max_memory_allocated(self._device)
            sample.cuda_peak_since = self._peak_since
            if workspace:
                sample.cuda_workspace = _cublas_workspace_bytes(self._device)
            if self._driver is None:
                from ..nvml import ProcessMemory

                self._driver = ProcessMemory.for_device(self._device) or False
            if self._driver:
                sample.driver_used = self._driver.used()
        if ledger is not None:
            sample.ledger = {k: v for k, v in ledger.as_dict().items()
                             if k in ("params", "grads", "master_params", "optimizer_state", "other", "offloaded")}
        self._add(sample)


class _TimedWork:
    """A Work without a future (gloo send/recv, which complete only when waited): timed from
    issue until its ``wait()`` returns; everything else goes to the real Work."""

    def __init__(self, work, on_done, on_wait):
        self._work, self._on_done, self._on_wait = work, on_done, on_wait

    def wait(self, *args, **kwargs):
        t, t0 = time.time(), time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        if self._on_done is not None:
            self._on_wait(t, time.perf_counter() - t0)
            self._on_done()
            self._on_done = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _device_seconds(work) -> float | None:
    """An NCCL work's device time (CUDA events NCCL records around the kernel on its own stream when
    TORCH_NCCL_ENABLE_TIMING=1, as bootstrap sets on nccl ranks), or None (gloo, or timing off)."""
    if work is None:
        return None
    try:
        ms = work._get_duration()
    except Exception:
        return None
    return ms / 1e3 if ms and ms > 0 else None


_ACTIVE: Recorder | None = None  # the recorder whose async collectives Work.wait() reports
_ORIGINAL_WAIT = None


def _time_waits(recorder: Recorder | None) -> None:
    """Time ``Work.wait()`` on the async collectives ``recorder`` saw (CommWait records): how long
    the training thread was blocked on each, the exposed part. Installed once per process on
    torch's Work class (DeepSpeed and FSDP call wait() on the Work itself, so a proxy would not
    see them); a wait on any other Work costs one dict lookup."""
    global _ACTIVE, _ORIGINAL_WAIT
    _ACTIVE = recorder
    if recorder is None or _ORIGINAL_WAIT is not None:
        return
    from torch._C._distributed_c10d import Work

    original = _ORIGINAL_WAIT = Work.wait

    def wait(self, *args, **kwargs):
        rec = _ACTIVE
        entry = rec._works.get(id(self)) if rec is not None else None
        if entry is None or entry[1]() is not self:
            return original(self, *args, **kwargs)
        rec._works.pop(id(self), None)
        seq = entry[0]
        t, t0 = time.time(), time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            rec._add(CommWait(rec.rank, seq, t, time.perf_counter() - t0))

    Work.wait = wait
