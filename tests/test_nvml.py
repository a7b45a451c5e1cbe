"""NVML answers -> GPU topology -> the planner's links (nbtool.nvml), without a GPU.

``RecordedNVML`` answers the calls nbtool makes the way pynvml does (names as
bytes or str, memory objects with total/used, ``NVMLError`` for a link that
does not exist), from a table per machine: an 8-GPU H100 SXM node (18 NVLink4
links per GPU, all to NVSwitches), two RTX 4090s on PCIe 4.0 x16 (no NVLink),
and two A100 PCIe cards joined by an NVLink bridge (direct links). The fake
stands in only for the driver; the parsing and the planner are real.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nbtool.metrics import MemorySample, RunRecords
from nbtool.nvml import ProcessMemory, link_summary, read, topology_text
from nbtool.plan.detect import hardware_from_facts

GiB = 2**30


class RecordedNVML:
    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[dict], driver: str = "550.54.15"):
        self.gpus, self.driver, self.calls = gpus, driver, []

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return self.driver.encode()

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self.gpus[h]
        return SimpleNamespace(total=g["total"], used=g["used"], free=g["total"] - g["used"])

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.gpus[h]["bus"])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self.gpus[h]["pcie"][0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self.gpus[h]["pcie"][1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.gpus[h]["pcie_max"][0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.gpus[h]["pcie_max"][1]

    def _link(self, h, link):
        links = self.gpus[h]["nvlink"]
        if link >= len(links):
            raise self.NVMLError("Not Supported")
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if self._link(h, link) else 0

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self._link(h, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._link(h, link)[1])

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return next(i for i, g in enumerate(self.gpus) if g["bus"].lower().endswith(bus.lower()[-12:]))

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.gpus[h].get("procs", [])]


def h100_node():
    switch = "00000000:A5:00.0"  # an NVSwitch's bus id: not one of the GPUs
    return [{"name": b"NVIDIA H100 80GB HBM3", "total": 80 * GiB, "used": int(0.5 * GiB),
             "bus": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "pcie": (5, 16), "pcie_max": (5, 16),
             "nvlink": [(4, switch)] * 18} for i in range(8)]


def rtx4090_pair():
    return [{"name": "NVIDIA GeForce RTX 4090", "total": 24 * GiB, "used": GiB, "bus": f"0000:0{i + 1}:00.0",
             "pcie": (4, 16), "pcie_max": (4, 16), "nvlink": []} for i in range(2)]


def a100_bridged_pair():
    buses = ["00000000:17:00.0", "00000000:65:00.0"]
    return [{"name": "NVIDIA A100-PCIE-40GB", "total": 40 * GiB, "used": 0, "bus": buses[i],
             "pcie": (4, 8), "pcie_max": (4, 16),  # running at x8 in an x16 card: said
             "nvlink": [(3, buses[1 - i].lower())] * 12} for i in range(2)]


def test_nvswitch_node():
    nvml = RecordedNVML(h100_node())
    topo = read(nvml)
    assert nvml.calls == ["init", "shutdown"] and topo["driver"] == "550.54.15"
    assert len(topo["gpus"]) == 8 and topo["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert all(link["peer"] == "switch" and link["version"] == 4 for link in topo["gpus"][3]["nvlink"])
    links = link_summary(topo)
    assert links["kind"] == "NVLink" and links["label"] == "NVLink4 x18 via NVSwitch (NVML)"
    assert links["bus_bandwidth"] == pytest.approx(18 * 25e9 * 0.78)  # ~351 GB/s, nccl-tests' H100 figure
    assert "GPU 0: NVIDIA H100 80GB HBM3, 80.0 GiB (0.50 GiB in use); PCIe 5.0 x16; NVLink 18 to NVSwitch" \
        in topology_text(topo)


def test_pcie_only_pair():
    topo = read(RecordedNVML(rtx4090_pair()))
    assert topo["gpus"][1]["nvlink"] == []  # the first link query raised NotSupported
    links = link_summary(topo)
    assert links == {"kind": "PCIe", "label": "PCIe 4.0 x16 (NVML)",
                     "bus_bandwidth": pytest.approx(16 * 1.969e9 * 0.65)}
    assert topology_text(topo).endswith("PCIe 4.0 x16; no NVLink")


def test_direct_nvlink_bridge_and_a_degraded_pcie_link():
    topo = read(RecordedNVML(a100_bridged_pair()))
    assert [link["peer"] for link in topo["gpus"][0]["nvlink"]] == [1] * 12  # bus ids matched across cases
    links = link_summary(topo)
    assert links["label"] == "NVLink3 x12 (NVML)"
    assert "to GPU 1" in topology_text(topo)
    topo["gpus"][0]["nvlink"] = []
    assert link_summary(topo)["label"] == "PCIe 4.0 x8 (NVML), capable of 4.0 x16"


def test_the_planner_uses_the_links_nvml_reports():
    facts = {"host_memory": 2048 * GiB, "cpus": 224, "nvml": read(RecordedNVML(h100_node())),
             "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": 80 * GiB}] * 8, "peer_access": True}
    hw = hardware_from_facts(facts, 8, "nccl")
    assert hw.link == "NVLink4 x18 via NVSwitch (NVML)" and hw.intra_bw == pytest.approx(351e9)
    without = hardware_from_facts({**facts, "nvml": None}, 8, "nccl")
    assert without.link == "peer access (NVLink or PCIe P2P)" and without.intra_bw == 20e9


def test_memory_outside_the_allocator_per_rank():
    """NVML's per-process figure on the rank's own GPU (found by PCI bus id), minus the allocator's
    reserved bytes: what the dashboard's status line shows as outside PyTorch."""
    from nbtool.widgets import Dashboard

    gpus = h100_node()
    gpus[3]["procs"] = [(4242, 30 * GiB), (999, 5 * GiB)]  # this rank, and another process on the same GPU
    mem = ProcessMemory(RecordedNVML(gpus), "00000000:48:00.0", 4242)
    assert mem.handle == 3 and mem.used() == 30 * GiB
    assert ProcessMemory(RecordedNVML(gpus), "00000000:48:00.0", 1).used() is None  # not on that GPU
    run = RunRecords("gpu", "fsdp", 2, t_start=0.0)
    run.add([MemorySample(r, 1.0, 0, "interval", GiB, cuda_reserved=28 * GiB, driver_used=30 * GiB + r * GiB)
             for r in range(2)])
    text = Dashboard.status_text(run)
    assert "outside PyTorch's allocator (driver minus reserved): rank 0 2.00 GiB, rank 1 3.00 GiB" in text
    cpu = RunRecords("cpu", "ddp", 2, t_start=0.0)
    cpu.add([MemorySample(0, 1.0, 0, "interval", GiB)])
    assert "outside PyTorch" not in Dashboard.status_text(cpu)
