"""%dist_checkpoint: save or load through the last strategy cell's strategy, on every rank."""
from __future__ import annotations

import ipyparallel as ipp
from IPython.core.error import UsageError

from ..cluster import RankCluster
from .common import prepare_cell


def checkpoint(cluster: RankCluster, action: str, path: str, optimizer: bool = True) -> dict:
    """%dist_checkpoint: save or load on every rank through the last strategy cell's strategy."""
    from ..execution import RankError, group_errors
    from ..faults import RankFailure
    from ..rank import strategies

    ranks = list(range(cluster.world_size))
    if cluster.options.multi_host and action == "save":  # every rank writes its part there
        cluster.check_shared(path, "%dist_checkpoint save")
    prepare_cell(cluster, ranks, None, collectives=True)
    ar = cluster.view(ranks).apply_async(strategies.checkpoint, action, path, optimizer)
    try:
        while not ar.wait(0.1):
            pass
    except KeyboardInterrupt:
        cluster.signal(ranks, "SIGINT")
        ar.wait(5)
        raise
    try:
        results = ar.get()
    except ipp.error.CompositeError as e:
        if all(ename == "StrategyError" for ename, *_ in e.elist):  # nothing prepared: a usage mistake
            raise UsageError(f"%dist_checkpoint {action}: {e.elist[0][1]}") from None
        raise RankError(group_errors((cluster.rank_of(info["engine_id"]), RankFailure(ename, evalue))
                                     for ename, evalue, _, info in e.elist)) from None
    info = results[0]
    if action == "save":
        print(f"saved step {info['steps']} to {info['path']}/{info['dir']} "
              f"({info['bytes'] / 2**20:.1f} MiB, {info['seconds']:.2f} s)")
    else:
        print(f"loaded step {info['steps']} from {info['path']}/{info['dir']} "
              f"(saved by {info['saved_by']}): {info['restored']}")
    return info
