"""Running one cell on a set of ranks: dispatch, live output, errors, interrupt, timeout.

The kernel's main thread waits in short ticks, so output refreshes and a
Ctrl-C (KeyboardInterrupt in the kernel) are handled here, never on
ipyparallel's network thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ipyparallel as ipp

from .cluster import RankCluster
from .options import label_ranks
from .rank_output import RankOutputView, snapshot

TICK_S = 0.05
INTERRUPT_GRACE_S = 5.0


class RankError(Exception):
    """One or more ranks raised; shows each distinct error once with its ranks."""

    def __init__(self, groups: list[tuple[list[int], object]]):
        self.groups = groups  # [(ranks, RemoteError-like)], first = shown first
        first_ranks, first = groups[0]
        super().__init__(_headline(first_ranks, first))

    def _render_traceback_(self):
        lines: list[str] = []
        for ranks, err in self.groups:
            lines.append(_headline(ranks, err))
            tb = getattr(err, "traceback", None)
            if tb:
                lines.extend(tb.splitlines())
            lines.append("")
        return lines


class CellTimeout(Exception):
    def _render_traceback_(self):
        return [f"CellTimeout: {self}"]


class RanksInterrupted(KeyboardInterrupt):
    def _render_traceback_(self):
        return [f"KeyboardInterrupt: {self}"]


def _headline(ranks: list[int], err) -> str:
    name = getattr(err, "ename", type(err).__name__)
    value = getattr(err, "evalue", str(err))
    return f"{label_ranks(ranks)}: {name}: {value}"


@dataclass
class CellResult:
    ranks: list[int]
    elapsed_s: float
    async_result: ipp.AsyncResult


def run_cell(
    cluster: RankCluster,
    code: str,
    ranks: list[int],
    *,
    in_kernel: bool,
    timeout: float | None = None,
    quiet: bool = False,
    on_tick=None,
) -> CellResult:
    """Execute ``code`` on ``ranks`` and block until every one is done.

    Raises RankError (some rank raised), CellTimeout (``timeout`` passed;
    unfinished ranks were interrupted) or RanksInterrupted (Ctrl-C, forwarded
    to the ranks as SIGINT). ``quiet`` hides the ranks' output, not errors.
    ``on_tick(children)`` is called from this (the kernel's main) thread on
    every wait tick, with the (rank, message future) pairs, to read live data.
    """
    view = cluster.view(ranks)
    t0 = time.perf_counter()
    ar = view.execute(code, silent=False, block=False)
    children = list(zip(ranks, ar._children))
    out = RankOutputView(in_kernel=in_kernel, enabled=not quiet)
    out.start()

    def texts():
        return [snapshot(r, f.output.metadata) for r, f in children]

    def unfinished():
        return [r for r, f in children if not f.done()]

    stop_reason = None
    try:
        while not ar.wait(TICK_S):
            out.update(texts())
            if on_tick is not None:
                on_tick(children)
            if timeout is not None and time.perf_counter() - t0 > timeout:
                stop_reason = "timeout"
                break
    except KeyboardInterrupt:
        stop_reason = "interrupt"

    # a timeout or Ctrl-C that lands after every rank finished: the cell simply finished
    late = unfinished() if stop_reason else []
    if stop_reason and late:
        stuck = _interrupt(cluster, ar, children, late)
        ar.wait_for_output(1.0)
        out.finish(texts())
        what = (
            f"cell exceeded --timeout {timeout:g}s; {label_ranks(late)} had not finished"
            if stop_reason == "timeout"
            else f"interrupted {label_ranks(late)}"
        )
        if stuck:
            what += (
                f"; {label_ranks(stuck)} did not stop within {INTERRUPT_GRACE_S:g}s "
                "(blocked in native code, e.g. a collective): %cluster restart to recover"
            )
        else:
            what += " (they stopped; the cluster is ready)"
        if stop_reason == "timeout":
            raise CellTimeout(what)
        raise RanksInterrupted(what)

    ar.wait_for_output(5.0)
    out.finish(texts())
    if not quiet:
        _show_rich_outputs(children, ranks[0])
    errors = _collect_errors(children)
    if errors:
        raise RankError(errors)
    return CellResult(ranks, time.perf_counter() - t0, ar)


def _interrupt(cluster: RankCluster, ar, children, late: list[int]) -> list[int]:
    """SIGINT the ranks still running; return those still running after the grace period."""
    if not late:
        return []
    try:
        cluster.signal(late, "SIGINT")
    except Exception:
        return late
    ar.wait(INTERRUPT_GRACE_S)
    return [r for r, f in children if not f.done()]


def _show_rich_outputs(children, rank: int) -> None:
    """Republish display_data (figures, widgets) from one rank into the notebook."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    for r, f in children:
        if r != rank:
            continue
        for content in f.output.metadata.get("outputs", []):
            shell.display_pub.publish(data=content["data"], metadata=content.get("metadata") or {})


def _collect_errors(children) -> list[tuple[list[int], object]]:
    by_key: dict[tuple[str, str], tuple[list[int], object]] = {}
    for rank, f in children:
        # execute requests resolve to the RemoteError rather than raising it
        err = f.exception() or f.result()
        if not isinstance(err, BaseException):
            continue
        key = (getattr(err, "ename", type(err).__name__), getattr(err, "evalue", str(err)))
        by_key.setdefault(key, ([], err))[0].append(rank)
    return sorted(by_key.values(), key=lambda g: g[0][0])
