"""Hardware facts of the running cluster, as a planner Hardware."""
from __future__ import annotations

from .inputs import GB, HARDWARE_PRESETS, Hardware, cublas_workspace


def hardware_from_facts(facts: dict, world_size: int, backend: str, places: list | None = None) -> Hardware:
    """CPU ranks: the gloo preset with a host's RAM split between its ranks; GPUs: their memory.

    ``places`` (launchers.Place per rank) gives nodes x devices per node; without it (or on one
    host) every rank is on one node. Rank 0's host stands for every host.

    GPU links: from NVML when the ranks have nvidia-ml-py (NVLink links and
    version, or the PCIe generation and width, turned into a bus bandwidth by
    nbtool.nvml.link_summary); without it NVLink and PCIe P2P look alike
    from torch, so a PCIe default. ``%commbench`` replaces either with a
    measurement (``Hardware.with_commbench``).
    """
    nodes = len({p.node_rank for p in places}) if places else 1
    per_node = max(p.local_world_size for p in places) if places and nodes > 1 else world_size
    where = f"{nodes} hosts x {per_node}" if nodes > 1 else f"{world_size}"
    if backend != "nccl" or not facts.get("gpus"):
        base = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
        ranks = "CPU rank" if nodes == 1 and world_size == 1 else "CPU ranks"
        return Hardware(f"{where} {ranks} (gloo{', this machine' if nodes == 1 else ''})", nodes, per_node,
                        facts["host_memory"] / per_node, facts["host_memory"], base.intra_bw, base.inter_bw,
                        base.intra_latency, base.inter_latency,
                        link=base.link if nodes == 1 else "loopback within a host, the network across",
                        peak_flops=base.peak_flops, host_link_bw=base.host_link_bw,
                        host_speed=base.host_speed, op_links=base.op_links,
                        matmul_flops=tuple(facts["matmul_flops"]) if facts.get("matmul_flops") else None)
    gpu = facts["gpus"][0]
    from ..nvml import link_summary

    name = f"{where}x {gpu['name']}{' (this machine)' if nodes == 1 else ''}"
    links = link_summary(facts.get("nvml") or {})
    workspace = cublas_workspace(gpu.get("major", 8), facts.get("cublas_config"))
    if links:
        return Hardware(name, nodes, per_node, gpu["memory"], facts["host_memory"], links["bus_bandwidth"], 10 * GB,
                        link=links["label"], workspace=workspace)
    return Hardware(name, nodes, per_node, gpu["memory"], facts["host_memory"], 20 * GB, 10 * GB,
                    link="peer access (NVLink or PCIe P2P)" if facts.get("peer_access") else "PCIe (assumed)",
                    workspace=workspace)
