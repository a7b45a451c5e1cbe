"""%cluster: start, stop, status, restart."""
from __future__ import annotations

from ..cluster import RankCluster
from ..options import ClusterOptions, label_ranks
from .common import progress_line


def start(opts: ClusterOptions, in_kernel: bool) -> RankCluster:
    return RankCluster.start(opts, progress=progress_line(in_kernel))


def status(cluster: RankCluster):
    from ..launchers import describe, hosts_text
    from ..widgets import StatusTable

    layout = cluster.layout
    where = ""
    if cluster.options.multi_host:
        job = f", job {cluster.slurm_job}" if cluster.slurm_job else ""
        where = (f"launcher {describe(cluster.options)}{job}; interface {cluster.ifname}; "
                 f"{hosts_text(cluster.places)}\n")
    header = where + (
        f"{layout.n} rank(s), backend {layout.backend}, "
        f"{'GPUs ' + ','.join(map(str, layout.gpus)) if layout.gpus else 'CPU'}; "
        f"collective timeout {cluster.collective_timeout:g}s; "
        "rss = resident set size of the engine process (OS figure)"
    )
    rows = cluster.status()
    if layout.gpus and not cluster.group_closed and not cluster.lost_ranks():
        from ..rank.bootstrap import hardware_facts
        from ..nvml import topology_text

        topology = cluster.view([0]).apply_sync(hardware_facts)[0].get("nvml")
        header += "\n" + (topology_text(topology) if topology else
                          "GPU links: unknown (pip install nvidia-ml-py on the ranks to read them from NVML)")
    lost = cluster.lost_ranks()
    if lost or cluster.group_closed:
        header += (f"\nprocess group unusable ({cluster.group_closed or 'engines lost'}"
                   f"{'; lost: ' + label_ranks(lost) if lost else ''}): "
                   f"%cluster restart brings back {layout.n} fresh rank(s)")
    return StatusTable(rows, header=header)
