"""%commbench: a collective sweep on the running cluster, plotted live."""
from __future__ import annotations

import sys

from ..cluster import RankCluster
from .. import protocol
from .common import prepare_cell
from .state import Session


def commbench(state: Session, cluster: RankCluster, ops: list[str], sizes: list[int], dtype: str, iters: int, warmup: int,
              ranks: list[int] | None, inplace: bool, in_kernel: bool, label: str = "", repeat: int = 5,
              min_batch_s: float = 0.0):
    """Run a %commbench sweep on the cluster; returns a CommbenchResult (plots live in a notebook).

    Without ``ranks`` on a cluster of several hosts it measures all ranks, then each link apart
    (``commbench.link_groups``: intra-host, inter-host), and returns a CommbenchLinks.
    """
    from ..commbench import CommbenchLinks, link_groups

    everyone = list(range(cluster.world_size))
    prepare_cell(cluster, everyone, None, collectives=True)  # once: every sweep runs on every rank
    groups = link_groups([p.node_rank for p in cluster.places]) if ranks is None and cluster.places else {}

    def sweep(members, name, link=""):
        return _sweep(cluster, ops, sizes, dtype, iters, warmup, members, inplace, in_kernel, name, repeat, min_batch_s,
                      link=link)

    if not groups:
        result = sweep(ranks or everyone, label)
    else:
        named = lambda part: f"{label}: {part}" if label else part
        result = CommbenchLinks([sweep(everyone, named("all ranks"))]
                                + [sweep(list(members), named(link), link) for link, members in groups.items()])
    state.commbench = result
    if result.wrong:
        print(f"commbench: {result.wrong} result element(s) were WRONG: the collective is broken "
              "for the sizes marked in the #wrong column", file=sys.stderr)
    return result


def _sweep(cluster: RankCluster, ops, sizes, dtype, iters, warmup, ranks, inplace, in_kernel, label, repeat,
           min_batch_s, link: str = ""):
    """One sweep over ``ranks`` (every rank takes part in making the sub-group), plotted live."""
    from ..commbench import DTYPES, CommbenchResult, element_count
    from ..rank import commbench as rank_bench

    everyone = list(range(cluster.world_size))
    n = len(ranks)
    counts = {op: sorted({element_count(op, s, n, DTYPES[dtype]) for s in sizes}) for op in ops}
    plot = plot_id = None
    if in_kernel:
        from ..widgets.commbench_view import SweepPlot
        from ..widgets.figures import replace_live, show_live

        plot = SweepPlot(ops, repeat)
        plot_id = show_live(plot.fig)
    # every rank takes part: creating the sub-group (if any) is collective over the world
    ar = cluster.view(everyone).apply_async(rank_bench.run_sweep, ops, counts, dtype, iters, warmup,
                                            tuple(ranks), inplace, plot is not None, repeat, min_batch_s)
    seen: dict = {}
    try:
        while not ar.wait(0.1):
            if plot is None:
                continue
            for f in ar._children:
                for key, row in protocol.entries(f, "commbench"):
                    seen[key] = row  # each pass sends every size again, its median so far
            if seen:
                plot.show_rows(list(seen.values()), n)
        per_rank = ar.get()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            cluster.signal(everyone, "SIGINT")
            ar.wait(5)
        if plot is not None:
            replace_live(plot_id, retire=plot)
        raise
    result = CommbenchResult.from_rank_rows(per_rank, backend=cluster.layout.backend, ranks=list(ranks),
                                            dtype=dtype, iters=iters, warmup=warmup, inplace=inplace, label=label,
                                            repeat=repeat, min_batch_s=min_batch_s, link=link)
    if plot is not None:  # the live plot's output becomes the result's static figure, in place
        replace_live(plot_id, result.figure(), retire=plot)
    return result
