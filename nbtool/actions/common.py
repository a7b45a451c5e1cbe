"""What several magics' actions share: the progress line, and the checks before ranks run anything."""
from __future__ import annotations

import sys

from IPython.core.error import UsageError

from ..cluster import RankCluster
from ..options import format_ranks


def progress_line(in_kernel: bool):
    from ..widgets import ProgressLine

    return ProgressLine(in_kernel)


def prepare_cell(cluster: RankCluster, ranks: list[int], collective_timeout: float | None, collectives: bool) -> None:
    """Checks before a cell runs: ranks alive, process group usable, watchdog timeout set."""
    check_alive(cluster, ranks)
    if cluster.group_closed:
        msg = (f"the process group is unusable ({cluster.group_closed}); "
               f"%cluster restart brings back {cluster.world_size} fresh rank(s)")
        if collectives:
            raise UsageError(msg)
        print(f"nbtool: {msg}; this cell runs, but any collective in it will fail", file=sys.stderr)
    cluster.set_collective_timeout(collective_timeout or cluster.options.collective_timeout)


def check_alive(cluster: RankCluster, ranks: list[int]) -> None:
    lost = sorted(set(ranks) & set(cluster.lost_ranks()))
    if lost:
        reasons = "; ".join(f"rank {r}: {cluster.exit_reason(r)}" for r in lost)
        raise UsageError(f"rank(s) {format_ranks(lost)} are no longer connected ({reasons}); "
                         f"%cluster restart brings back {cluster.world_size} fresh rank(s)")
