"""GPU topology from NVML (nvidia-ml-py, optional): model, memory, NVLink and PCIe links.

``read(nvml)`` asks an NVML module (``pynvml``; in tests, recorded answers
with the same calls) for each GPU's name and memory, its PCIe link
(current and maximum generation and width) and its NVLink links (state and
version of each, and what each leads to: another GPU of this machine by its
PCI bus id, or an NVSwitch). ``link_summary`` turns that into what the
planner needs: the kind of link between the GPUs and its bus bandwidth.

Bus bandwidth from links, approximate (nccl-tests busbw of a large
all_reduce): 25 GB/s per NVLink link (versions 2-4) per direction times 0.78
(A100: 12 links -> ~230 GB/s; H100: 18 -> ~350 GB/s), PCIe lanes times their
per-lane rate times 0.65 (PCIe 4.0 x16 -> ~20 GB/s). ``%commbench`` replaces
these with a measurement.
"""
from __future__ import annotations

NVLINK_GBPS_PER_LINK = 25e9
NVLINK_EFFICIENCY = 0.78
PCIE_LANE_GBPS = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
PCIE_EFFICIENCY = 0.65
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _bus_id(pci) -> str:
    # pynvml answers busId as bytes or str, upper or lower case, with 8 or 4 domain digits
    bus = _text(getattr(pci, "busId", "")).lower()
    return bus[-12:] if len(bus) >= 12 else bus


def read(nvml) -> dict:
    """{"gpus": [...], "driver": version} for every GPU NVML sees (see the module docstring)."""
    nvml.nvmlInit()
    try:
        gpus = []
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        buses = {_bus_id(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        for i, h in enumerate(handles):
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            gpu = {"index": i, "name": _text(nvml.nvmlDeviceGetName(h)), "memory_total": int(mem.total),
                   "memory_used": int(mem.used),
                   "pcie": {"gen": _int(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                            "width": _int(nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                            "max_gen": _int(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                            "max_width": _int(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)},
                   "nvlink": []}
            for link in range(MAX_LINKS):
                try:
                    if not nvml.nvmlDeviceGetNvLinkState(h, link):
                        continue
                    version = int(nvml.nvmlDeviceGetNvLinkVersion(h, link))
                    remote = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
                except nvml.NVMLError:  # no such link, or NVLink not supported on this GPU
                    break
                gpu["nvlink"].append({"link": link, "version": version,
                                      "peer": buses.get(remote, "switch")})
            gpus.append(gpu)
        return {"gpus": gpus, "driver": _text(nvml.nvmlSystemGetDriverVersion())}
    finally:
        nvml.nvmlShutdown()


def _int(fn, handle) -> int | None:
    try:
        return int(fn(handle))
    except Exception:  # not reported on this GPU
        return None


def link_summary(topology: dict) -> dict:
    """{"kind": "NVLink"|"PCIe", "label": ..., "bus_bandwidth": bytes/s} between GPU 0 and the others."""
    gpus = topology.get("gpus") or []
    if not gpus:
        return {}
    first = gpus[0]
    links = first["nvlink"]
    if links and len(gpus) > 1:
        version = max(link["version"] for link in links)
        switch = any(link["peer"] == "switch" for link in links)
        # through NVSwitch every link serves every peer; direct links: the fewest to any one peer
        per_peer = [sum(1 for link in links if link["peer"] == j) for j in range(1, len(gpus))]
        n = len(links) if switch else min(per_peer)
        if n:
            return {"kind": "NVLink", "bus_bandwidth": n * NVLINK_GBPS_PER_LINK * NVLINK_EFFICIENCY,
                    "label": f"NVLink{version} x{n}{' via NVSwitch' if switch else ''} (NVML)"}
    gen, width = first["pcie"]["gen"], first["pcie"]["width"]
    if not gen or not width:
        return {}
    label = f"PCIe {gen}.0 x{width} (NVML)"
    if (first["pcie"]["max_gen"] or gen) > gen or (first["pcie"]["max_width"] or width) > width:
        label += f", capable of {first['pcie']['max_gen']}.0 x{first['pcie']['max_width']}"
    return {"kind": "PCIe", "bus_bandwidth": width * PCIE_LANE_GBPS.get(gen, 0) * PCIE_EFFICIENCY,
            "label": label}


def topology_text(topology: dict) -> str:
    """One line per GPU: model, memory, PCIe link, NVLink links by peer."""
    lines = []
    for g in topology.get("gpus", []):
        peers: dict = {}
        for link in g["nvlink"]:
            peers[link["peer"]] = peers.get(link["peer"], 0) + 1
        nv = ", ".join(f"{n} to {'NVSwitch' if p == 'switch' else f'GPU {p}'}" for p, n in peers.items())
        pcie = g["pcie"]
        lines.append(f"GPU {g['index']}: {g['name']}, {g['memory_total'] / 2**30:.1f} GiB "
                     f"({g['memory_used'] / 2**30:.2f} GiB in use); PCIe {pcie['gen']}.0 x{pcie['width']}"
                     + (f"; NVLink {nv}" if nv else "; no NVLink"))
    return "\n".join(lines)


class ProcessMemory:
    """The bytes the driver attributes to one process on one GPU (NVML's per-process figure),
    for the recorder's sampler: the handle is looked up once, by the GPU's PCI bus id (CUDA's and
    NVML's device orders can differ)."""

    def __init__(self, nvml, pci_bus_id: str, pid: int):
        self.nvml, self.pid = nvml, pid
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)

    def used(self) -> int | None:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory is not None]
        return int(sum(mine)) if mine else None

    @classmethod
    def for_device(cls, device) -> "ProcessMemory | None":
        """This process on torch ``device``, or None (no nvidia-ml-py, no driver, no bus id)."""
        import os

        try:
            import pynvml
            import torch

            p = torch.cuda.get_device_properties(device)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            return cls(pynvml, bus, os.getpid())
        except Exception:
            return None


def detect() -> dict | None:
    """The topology of this machine's GPUs, or None without nvidia-ml-py or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        return read(pynvml)
    except Exception:  # no driver, no GPU
        return None
