"""Hardware facts of the running cluster, as a planner Hardware."""
from __future__ import annotations

from .inputs import GB, HARDWARE_PRESETS, Hardware


def hardware_from_facts(facts: dict, world_size: int, backend: str) -> Hardware:
    """CPU ranks: the gloo preset with this host's RAM split between ranks; GPUs: their memory.

    GPU links: from NVML when the ranks have nvidia-ml-py (NVLink links and
    version, or the PCIe generation and width, turned into a bus bandwidth by
    nbtool.nvml.link_summary); without it NVLink and PCIe P2P look alike
    from torch, so a PCIe default. ``%commbench`` replaces either with a
    measurement (``Hardware.with_commbench``).
    """
    if backend != "nccl" or not facts.get("gpus"):
        base = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
        return Hardware(f"{world_size} CPU ranks (gloo, this machine)", 1, world_size,
                        facts["host_memory"] / world_size, facts["host_memory"], base.intra_bw, base.inter_bw,
                        base.intra_latency, base.inter_latency, link=base.link, peak_flops=base.peak_flops,
                        host_link_bw=base.host_link_bw)
    gpu = facts["gpus"][0]
    from ..nvml import link_summary

    links = link_summary(facts.get("nvml") or {})
    if links:
        return Hardware(f"{world_size}x {gpu['name']} (this machine)", 1, world_size, gpu["memory"],
                        facts["host_memory"], links["bus_bandwidth"], 10 * GB, link=links["label"])
    return Hardware(f"{world_size}x {gpu['name']} (this machine)", 1, world_size, gpu["memory"], facts["host_memory"],
                    20 * GB, 10 * GB,
                    link="peer access (NVLink or PCIe P2P)" if facts.get("peer_access") else "PCIe (assumed)")
