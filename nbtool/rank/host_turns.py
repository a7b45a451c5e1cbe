"""Ranks of one host take turns at a phase that needs much memory for a short while (engine side).

``--memory-timeline``'s analysis is such a phase: torch materialises what its
profiler recorded, then works out the categories, and a rank holds GBs while
it does (measured: 2.7 GB a rank for 5 steps of fsdp --tp 2 --pp 2 on the
tutorial model). Run on every rank of a host at once, 8 ranks of 24 GB had
the kernel's OOM killer take one.

Where the caller's guess of the cost says the host's available memory (less
a reserve) holds every rank's at once, they all go at once. Else the first
rank of the host to get there goes alone and measures what the phase cost it
(its RSS growth, measured before it lets go); the others then go at most k
at a time, k = the host's available memory less the reserve over that cost
(at least 1). They meet through a lock file and a small JSON state
in the system's temporary directory, named by the cluster's rendezvous and
the phase, so nothing goes over the network. Bounded: a rank that waited
``wait_s`` goes anyway (a first rank that died never holds up the rest).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time

from .bootstrap import rss

# left free on the host beside the ranks admitted: a fraction of its memory, at least this many bytes
RESERVE_FRACTION, RESERVE_MIN = 0.15, 1 << 30
MARGIN = 1.25  # a later rank's cost taken as the first's times this (stages and ranks differ a little)


class Turn:
    """A rank's turn: ``waited_s`` before it, ``first`` (it went alone and measured the cost), ``slots``
    (how many of the host's ranks went at once after the first)."""

    def __init__(self):
        self.waited_s, self.first, self.slots = 0.0, False, 1
        self.height = None  # RSS when the body said its memory was at its height

    def at_height(self) -> None:
        """Called by the body when it holds the most (before it lets go): what the phase costs is measured here."""
        self.height = rss()[0]


@contextlib.contextmanager
def host_turns(phase: str, ranks_on_host: int, guess: int | None = None, wait_s: float = 300.0,
               poll_s: float = 0.1):
    """Run the ``with`` body in this rank's turn among the ``ranks_on_host`` ranks of its host that reach
    ``phase`` (a name every one of them gives alike). The body calls ``turn.at_height()`` where it
    holds the most (the cost: the RSS growth since its turn began), then lets go of that memory before
    it ends, so the next rank may start as soon as it is over. ``guess``: the cost in bytes a rank
    expects; where the host's room holds ``ranks_on_host`` of them, no turns."""
    turn = Turn()
    if ranks_on_host <= 1 or (guess is not None and ranks_on_host * MARGIN * guess <= _room()):
        yield turn
        return
    base = os.path.join(tempfile.gettempdir(), f"nbtool-turns-{os.getuid()}-{phase}")
    t0 = time.monotonic()
    while True:
        with _locked(base) as state:
            if "first" not in state:
                state.update(first="running", running=1, done=0)
                turn.first = True
                break
            if state["first"] == "done" and state["running"] < state["slots"]:
                state["running"] += 1
                turn.slots = state["slots"]
                break
            if time.monotonic() - t0 > wait_s:
                state["running"] += 1
                break
        time.sleep(poll_s)
    turn.waited_s = time.monotonic() - t0
    before = rss()[0]
    try:
        yield turn
    finally:
        cost = max(0, turn.height - before) if turn.height is not None else None
        with _locked(base) as state:
            state["running"] -= 1
            state["done"] = state.get("done", 0) + 1
            if turn.first:
                state["slots"] = max(1, int(_room() // (MARGIN * cost))) if cost else ranks_on_host
                state["first"] = "done"
                turn.slots = state["slots"]
            if state["done"] >= ranks_on_host:  # the host's last: nothing left to meet over
                state.clear()
                with contextlib.suppress(OSError):
                    os.remove(base + ".lock")


def _available() -> tuple[int, int]:
    """(bytes available, total bytes) of this host's memory."""
    import psutil

    host = psutil.virtual_memory()
    return host.available, host.total


def _room() -> float:
    """Bytes of this host's available memory beyond the reserve."""
    available, total = _available()
    return available - max(RESERVE_FRACTION * total, RESERVE_MIN)


@contextlib.contextmanager
def _locked(base: str):
    """The phase's state (a dict) under its lock file; written back as the block leaves it (removed when
    left empty)."""
    with open(base + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                with open(base + ".json") as f:
                    state = json.load(f)
            except (OSError, ValueError):
                state = {}
            yield state
            if state:
                with open(base + ".json", "w") as f:
                    json.dump(state, f)
            else:
                with contextlib.suppress(OSError):
                    os.remove(base + ".json")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
