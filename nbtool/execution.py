"""Running one cell on a set of ranks: dispatch, live output, errors, interrupt, timeout.

The kernel's main thread waits in short ticks, so output refreshes and a
Ctrl-C (KeyboardInterrupt in the kernel) are handled here, never on
ipyparallel's network thread.
"""
from __future__ import annotations

import enum
import sys
import time

from . import faults
from .cluster import GroupClosed, RankCluster
from .options import label_ranks
from .widgets.rank_output import RankOutputView, snapshot

TICK_S = 0.05
# after a rank fails, how long the others may keep running before they are stopped
# (they are usually released at once: a dead peer breaks their collective)
PEER_GRACE_S = 2.0
# a rank whose engine has not begun the cell by then does not respond (stopped, suspended)
UNRESPONSIVE_S = 10.0


class RankError(Exception):
    """One or more ranks raised; shows each distinct error once with its ranks.

    The cause comes first (a dead rank, then real errors), errors that follow
    from it (a peer's closed connection, an interrupt) after; ``notes`` say what
    nbtool did about it.
    """

    def __init__(self, groups: list[tuple[list[int], object]], notes: list[str] | None = None):
        self.groups = groups  # [(ranks, RemoteError-like)], first = shown first
        self.notes = [n for n in (notes or []) if n]
        first_ranks, first = groups[0]
        super().__init__(_headline(first_ranks, first))

    def _render_traceback_(self):
        lines: list[str] = []
        for i, (ranks, err) in enumerate(self.groups):
            lines.append(_headline(ranks, err))
            tb = getattr(err, "traceback", None)
            # a consequence (a peer's closed connection, the interrupt nbtool sent) needs no traceback
            if tb and not (i and faults.is_consequential(err)):
                lines.extend(tb.splitlines())
            lines.append("")
        lines.extend(f"nbtool: {n}" for n in self.notes)
        return lines


class CellTimeout(Exception):
    def _render_traceback_(self):
        return [f"CellTimeout: {self}"]


class RanksUnresponsive(Exception):
    def _render_traceback_(self):
        return [f"RanksUnresponsive: {self}"]


class Stop(enum.Enum):
    """Why run_cell stopped waiting for the ranks before they all finished."""

    FAILURE = "a rank failed"
    TIMEOUT = "--timeout passed"
    UNRESPONSIVE = "an engine does not respond"
    INTERRUPT = "Ctrl-C"


class RanksInterrupted(KeyboardInterrupt):
    def _render_traceback_(self):
        return [f"KeyboardInterrupt: {self}"]


def _headline(ranks: list[int], err) -> str:
    name = getattr(err, "ename", type(err).__name__)
    value = getattr(err, "evalue", str(err))
    return f"{label_ranks(ranks)}: {name}: {value}"


def run_cell(cluster: RankCluster, code: str, ranks: list[int], *, in_kernel: bool, timeout: float | None = None,
             quiet: bool = False, on_tick=None, progress=None) -> None:
    """Execute ``code`` on ``ranks`` and block until every one is done.

    Raises RankError (some rank raised or died; the others were stopped
    after PEER_GRACE_S), CellTimeout (``timeout`` passed; unfinished ranks
    were interrupted), RanksInterrupted (Ctrl-C, forwarded to the ranks as
    SIGINT) or RanksUnresponsive (a rank's engine had not begun the cell after
    UNRESPONSIVE_S). Ranks that an interrupt cannot stop (blocked in a collective)
    are released by ``faults.release``. The hang watchdog's reports are
    printed while the cell runs. ``quiet`` hides the ranks' output, not
    errors. ``on_tick(children)`` is called from this (the kernel's main)
    thread on every wait tick, with the (rank, message future) pairs.
    """
    progress = progress or (lambda m: print(f"nbtool: {m}", file=sys.stderr, flush=True))
    view = cluster.view(ranks)
    t0 = time.perf_counter()
    ar = view.execute(code, silent=False, block=False)
    children = list(zip(ranks, ar._children))
    out = RankOutputView(in_kernel=in_kernel, enabled=not quiet)
    out.start()
    hangs = faults.HangWatch(cluster, children)

    def texts():
        return [snapshot(r, f.output.metadata) for r, f in children]

    def unfinished():
        return [r for r, f in children if not f.done()]

    stop_reason, failed_at = None, None  # a Stop once the loop gives up waiting
    try:
        while not ar.wait(TICK_S):
            out.update(texts())
            if on_tick is not None:
                on_tick(children)
            hangs.tick()
            if failed_at is None and any(f.done() and _error_of(f) is not None for _, f in children):
                failed_at = time.perf_counter()
            if failed_at is not None and time.perf_counter() - failed_at > PEER_GRACE_S:
                stop_reason = Stop.FAILURE
                break
            if timeout is not None and time.perf_counter() - t0 > timeout:
                stop_reason = Stop.TIMEOUT
                break
            if time.perf_counter() - t0 > UNRESPONSIVE_S and _silent(children):
                stop_reason = Stop.UNRESPONSIVE
                break
    except KeyboardInterrupt:
        stop_reason = Stop.INTERRUPT

    # a timeout or Ctrl-C that lands after every rank finished: the cell simply finished
    late = unfinished() if stop_reason else []
    released = None
    if stop_reason is Stop.UNRESPONSIVE:
        silent = _silent(children)
        others = [r for r in late if r not in silent]
        released = faults.release(cluster, children, others, progress, unresponsive=silent) if others else None
        out.finish(texts())
        cluster.group_closed = cluster.group_closed or GroupClosed(GroupClosed.UNRESPONSIVE,
                                                                   f"{label_ranks(silent)} stopped responding")
        what = (f"{label_ranks(silent)} did not start the cell within {UNRESPONSIVE_S:g}s: the engine does not "
                "respond (its process is stopped or suspended, or its machine is asleep)")
        if released is not None:
            what += "; " + released.note()
        raise RanksUnresponsive(what + f"; %cluster restart brings back {cluster.world_size} fresh rank(s)")
    if late:
        outputs = texts()  # what the ranks printed before a restart loses them
        released = faults.release(cluster, children, late, progress)
        if not released.restarted:
            ar.wait_for_output(1.0)
            outputs = texts()
        out.finish(outputs)
        if stop_reason is not Stop.FAILURE:
            what = (f"cell exceeded --timeout {timeout:g}s; {label_ranks(late)} had not finished"
                    if stop_reason is Stop.TIMEOUT else f"interrupted {label_ranks(late)}")
            if released.released or released.restarted:
                what += "; " + released.note()
            else:
                what += " (they stopped; the cluster is ready)"
            raise (CellTimeout if stop_reason is Stop.TIMEOUT else RanksInterrupted)(what)
    else:
        ar.wait_for_output(5.0)
        out.finish(texts())
    if not quiet and not (released and released.restarted):
        _show_rich_outputs(children, ranks[0])
    errors = _collect_errors(cluster, children, texts() if not (released and released.restarted) else None)
    if errors:
        notes = [released.note() if released else ""]
        if any(getattr(e, "ename", "") == "RankDied" for _, e in errors) and not (released and released.restarted):
            cluster.group_closed = cluster.group_closed or GroupClosed(GroupClosed.RANK_DIED, "a rank died")
            notes.append(f"{cluster.lost_text()} gone; %cluster restart brings back {cluster.world_size} rank(s)")
        raise RankError(errors, notes)
    if released is not None and released.restarted:
        raise RankError([(late, faults.RankFailure("RanksRestarted", released.note()))])


def _show_rich_outputs(children, rank: int) -> None:
    """Republish display_data (figures, widgets) from one rank into the notebook."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    for content in dict(children)[rank].output.metadata.get("outputs", []):
        shell.display_pub.publish(data=content["data"], metadata=content.get("metadata") or {})


def _silent(children) -> list[int]:
    """Ranks that have not begun executing (no execute_input from their engine yet)."""
    return [r for r, f in children if not f.done() and f.output.metadata.get("execute_input") is None]


def _error_of(f):
    """The RemoteError of a finished execute request, or None (they resolve to it, not raise it)."""
    err = f.exception() or f.result()
    return err if isinstance(err, BaseException) else None


def _collect_errors(cluster, children, texts) -> list[tuple[list[int], object]]:
    """Distinct errors with their ranks: dead ranks, then causes, then consequences."""
    found = []
    for i, (rank, f) in enumerate(children):
        err = _error_of(f) if f.done() else None
        if err is None:
            continue
        if faults.is_engine_death(err):
            err = faults.death_record(cluster, rank, texts[i] if texts else "")
        found.append((rank, err))
    return group_errors(found)


def group_errors(rank_errors) -> list[tuple[list[int], object]]:
    """[(rank, error)] -> [(ranks, error)], one per distinct error: dead ranks, then causes, then consequences."""
    by_key: dict[tuple[str, str], tuple[list[int], object]] = {}
    for rank, err in rank_errors:
        key = (getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err)))
        by_key.setdefault(key, ([], err))[0].append(rank)

    def order(group):
        ranks, err = group
        kind = 0 if getattr(err, "ename", "") == "RankDied" else 2 if faults.is_consequential(err) else 1
        return kind, ranks[0]

    return sorted(by_key.values(), key=order)
