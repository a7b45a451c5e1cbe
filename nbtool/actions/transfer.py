"""%dist_push and %dist_pull: kernel variables to the ranks and back."""
from __future__ import annotations

import ipyparallel as ipp
from IPython.core.error import UsageError

from ..cluster import RankCluster
from ..options import format_ranks
from .common import check_alive


def push(cluster: RankCluster, values: dict, ranks: list[int]) -> None:
    check_alive(cluster, ranks)
    cluster.view(ranks).push(values, block=True)


def pull(cluster: RankCluster, names: list[str], rank: int | None) -> dict:
    ranks = [rank] if rank is not None else list(range(cluster.world_size))
    check_alive(cluster, ranks)
    out = {}
    for name in names:
        try:
            values = cluster.view(ranks).pull(name, block=True)
        except ipp.error.CompositeError as e:
            bad = sorted(cluster.rank_of(err[3]["engine_id"]) for err in e.elist if err[3])
            raise UsageError(f"{name!r} is not defined on rank(s) {format_ranks(bad) or '?'}; "
                             "assign it in a %%distributed cell first") from None
        except ipp.error.RemoteError:
            raise UsageError(f"{name!r} is not defined on rank {rank}; assign it in a %%distributed cell first") from None
        out[name] = values[0] if rank is not None else list(values)
    return out
