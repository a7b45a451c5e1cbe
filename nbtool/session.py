"""What each magic does once its line is parsed: the kernel-side actions.

Magics call exactly one function here; these wire the cluster and execution
layers to the notebook's display.
"""
from __future__ import annotations

import ipyparallel as ipp
from IPython.core.error import UsageError

from .cluster import RankCluster
from .execution import run_cell
from .options import ClusterOptions, format_ranks


def start(opts: ClusterOptions, in_kernel: bool) -> RankCluster:
    from .widgets import ProgressLine

    return RankCluster.start(opts, progress=ProgressLine(in_kernel))


def stop(cluster: RankCluster) -> None:
    cluster.stop()


def status(cluster: RankCluster):
    from .widgets import StatusTable

    layout = cluster.layout
    header = (
        f"{layout.n} rank(s), backend {layout.backend}, "
        f"{'GPUs ' + ','.join(map(str, layout.gpus)) if layout.gpus else 'CPU'}; "
        "rss = resident set size of the engine process (OS figure)"
    )
    return StatusTable(cluster.status(), header=header)


def run(cluster: RankCluster, code: str, ranks: list[int], *, in_kernel: bool,
        timeout: float | None, quiet: bool) -> None:
    _check_alive(cluster, ranks)
    run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet)


def run_strategy(cluster: RankCluster, code: str, spec, *, in_kernel: bool, timeout: float | None,
                 quiet: bool, export_config: str | None) -> None:
    """Install ``strategy`` on every rank, run the cell, then print the strategy's one-line summary."""
    from .rank import strategies
    from .rank.strategies.spec import deepspeed_config, dumps_config

    ranks = list(range(cluster.world_size))
    _check_alive(cluster, ranks)
    if export_config:
        text = dumps_config(deepspeed_config(spec, cluster.world_size))
        try:
            with open(export_config, "w") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"--export-config {export_config!r}: {e.strerror}") from None
    cluster.view(ranks).apply_sync(strategies.install, spec)
    run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet)
    if not quiet:
        summary = cluster.view([0]).apply_sync(strategies.last_summary)[0]
        if summary:
            print(summary)
        if export_config:
            print(f"DeepSpeed config written to {export_config}")


def push(cluster: RankCluster, values: dict, ranks: list[int]) -> None:
    _check_alive(cluster, ranks)
    cluster.view(ranks).push(values, block=True)


def pull(cluster: RankCluster, names: list[str], rank: int | None) -> dict:
    ranks = [rank] if rank is not None else list(range(cluster.world_size))
    _check_alive(cluster, ranks)
    out = {}
    for name in names:
        try:
            values = cluster.view(ranks).pull(name, block=True)
        except ipp.error.CompositeError as e:
            bad = sorted(cluster.rank_of(err[3]["engine_id"]) for err in e.elist if err[3])
            raise UsageError(
                f"{name!r} is not defined on rank(s) {format_ranks(bad) or '?'}; "
                "assign it in a %%distributed cell first"
            ) from None
        except ipp.error.RemoteError:
            raise UsageError(f"{name!r} is not defined on rank {rank}; assign it in a %%distributed cell first") from None
        out[name] = values[0] if rank is not None else list(values)
    return out


def _check_alive(cluster: RankCluster, ranks: list[int]) -> None:
    alive = set(cluster.client.ids)
    lost = [r for r in ranks if cluster.engine_ids[r] not in alive]
    if lost:
        raise UsageError(
            f"rank(s) {format_ranks(lost)} are no longer connected (engine died or was stopped); "
            "%cluster restart brings back a full cluster"
        )
