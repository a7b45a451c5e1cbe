"""Hang watchdog: which collective each rank is in, and for how long (engine side).

Installed once per engine life by bootstrap: every public torch.distributed
collective is wrapped to note its call (the outermost one only) while it is
in flight; async calls stay noted until their work completes. A daemon
thread looks every ``POLL_S``; a collective in flight for longer than the
timeout is reported once to the kernel (an ipyparallel data message) with
the op, its size, this rank's collective sequence number and the main
thread's Python stack. The kernel asks a rank that is not in a collective
for its stack with SIGUSR1 (delivered through ipyparallel's nanny).

The cost is one dict insert and delete per collective, and a completion check
of the async ones still noted (finished ones are let go); sizes are worked out
only when a report is made.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from .. import protocol
from .collective_calls import complete, describe_call, is_async, targets

POLL_S = 0.5
DEFAULT_TIMEOUT_S = 60.0

_local = threading.local()
@dataclass(slots=True)
class InFlight:
    """A collective this rank has entered and not finished (by sequence number in _inflight)."""

    name: str  # the torch.distributed function called
    args: tuple | None  # the call's arguments while it runs; None once only its description is kept
    kwargs: dict | None
    t0: float  # time.monotonic() at entry
    work: object = None  # an async call's Work, until it completes
    description: tuple | None = None  # (op, size, group size, dtype), kept instead of tensors


_inflight: dict[int, InFlight] = {}
_state = {"issued": 0, "timeout_s": DEFAULT_TIMEOUT_S, "rank": -1}
_reported: set[int] = set()
_thread: threading.Thread | None = None
_observer = None  # see observe()
_HERE = os.path.dirname(__file__)


def install(rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wrap the collectives, start the watch thread and the SIGUSR1 stack reporter (once)."""
    global _thread
    _state.update(rank=rank, timeout_s=timeout_s)
    wrapped: dict = {}  # one wrapper per function: dist.isend must stay c10d.isend (P2POp checks it)
    for module, attr, name in targets():
        fn = getattr(module, attr)
        if not getattr(fn, "_nbtool_watched", False):
            if id(fn) not in wrapped:
                wrapped[id(fn)] = _wrap(name, fn)
            setattr(module, attr, wrapped[id(fn)])
    if _thread is None:
        _thread = threading.Thread(target=_watch, name="nbtool-watchdog", daemon=True)
        _thread.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, _on_stack_request)


def observe(call) -> None:
    """Hand every outermost collective to ``call(fn, name, args, kwargs)`` (which makes the call
    and returns its result), or stop with None: how the metrics recorder sees collectives.

    The recorder goes through these wrappers rather than patching torch.distributed itself:
    they are installed once per engine life, so a reference DeepSpeed captures (its comm
    backend keeps ``all_gather_into_tensor`` from the first zero cell) stays valid for every
    later recording.
    """
    global _observer
    _observer = call


def installed() -> bool:
    return _thread is not None


def configure(timeout_s: float) -> None:
    """Set the per-collective timeout (seconds) for the next cells."""
    _state["timeout_s"] = float(timeout_s)


def state() -> dict:
    """This rank's collective count, timeout, and what is in flight now."""
    now = time.monotonic()
    return {"rank": _state["rank"], "issued": _state["issued"], "timeout_s": _state["timeout_s"],
            "inflight": [_describe(seq, e, now) for seq, e in sorted(list(_inflight.items()))]}


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_local, "depth", 0):  # a wrapper calling its replacement: counted once
            return fn(*args, **kwargs)
        release_finished(quick=True)
        _state["issued"] += 1
        seq = _state["issued"]
        entry = InFlight(name, args, kwargs, time.monotonic())
        _inflight[seq] = entry
        _local.depth = 1
        done = True
        try:
            observer = _observer
            result = (observer(fn, name, args, kwargs) if observer is not None
                      else complete(name, fn(*args, **kwargs)))
            if is_async(name, kwargs) and hasattr(result, "is_completed"):
                # in flight until the work completes (seen by the next poll). Keep its description,
                # not its tensors: holding those until then would keep freed buffers alive
                entry.description, entry.args, entry.kwargs = describe_call(name, args, kwargs), None, None
                entry.work, done = result, False
            return result
        finally:
            _local.depth = 0
            if done:
                _inflight.pop(seq, None)

    wrapper._nbtool_watched = True
    return wrapper


def _describe(seq: int, entry: InFlight, now: float) -> dict:
    op, size, n, dtype = entry.description or describe_call(entry.name, entry.args, entry.kwargs)
    return {"seq": seq, "op": op, "call": entry.name, "size_bytes": size, "group_size": n, "dtype": dtype,
            "age_s": round(now - entry.t0, 3), "async": entry.work is not None}


def main_stack() -> list[str]:
    """The main thread's Python stack, innermost last, without this module's wrapper frames."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return [] if frame is None else _stack(frame)


def _stack(frame) -> list[str]:
    return traceback.format_list([f for f in traceback.extract_stack(frame) if os.path.dirname(f.filename) != _HERE])


def _publish(key: str, value: dict) -> None:
    try:
        from ipyparallel.datapub import publish_data

        publish_data({key: value})
    except Exception:  # outside an engine, or between cells: nobody to tell
        pass


def _watch() -> None:
    while True:
        time.sleep(POLL_S)
        try:
            _check()
        except Exception:  # the watchdog must never take the engine down
            pass


def release_finished(quick: bool = False) -> None:
    """Let go of the async calls whose work has completed. Their Work holds the collective's tensors:
    kept until the next poll (POLL_S), a step-1 DDP work kept its gradient bucket alive through step 2
    after DDP rebuilt its buckets (+1 gradient copy at that step's peak, 450 MiB for a 117M model on an
    H200); so also at each new collective and at each optimizer step (strategies call this).
    ``quick`` (on a collective's path): the completion flag only, no future asked for."""
    for seq, entry in list(_inflight.items()):
        work = entry.work
        if work is not None and _finished(work, quick):
            _inflight.pop(seq, None)


def _finished(work, quick: bool = False) -> bool:
    """Whether an async work is done: its flag, or its future (gloo completes the future a moment
    before the flag, and DDP has already waited on the future when the optimizer step comes)."""
    try:
        if work.is_completed():
            return True
    except Exception:
        return True
    if quick:
        return False
    try:
        return work.get_future().done()
    except Exception:  # gloo send/recv: no future
        return False


def _check() -> None:
    release_finished()
    now = time.monotonic()
    for seq, entry in list(_inflight.items()):
        if now - entry.t0 > _state["timeout_s"] and seq not in _reported:
            _reported.add(seq)
            from ..flight_recorder import read

            report = {**_describe(seq, entry, now), "rank": _state["rank"], "issued": _state["issued"],
                      "timeout_s": _state["timeout_s"], "stack": main_stack(), "flight": read()}
            _publish(protocol.hang_key(_state["rank"], seq), report)


def _on_stack_request(signum, frame) -> None:
    """SIGUSR1: publish where this rank's main thread is (it runs Python, or the handler would not)."""
    stack = _stack(frame)
    now = time.monotonic()
    from ..flight_recorder import read

    _publish(protocol.stack_key(_state["rank"]),
             {"rank": _state["rank"], "issued": _state["issued"], "stack": stack, "flight": read(),
              "inflight": [_describe(s, e, now) for s, e in sorted(list(_inflight.items()))]})
