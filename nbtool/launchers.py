"""Kernel side: engines on other machines, through ipyparallel's launchers (ssh, slurm, mpi, a profile).

nbtool builds no launcher of its own: ``cluster_kwargs`` turns ``%cluster
start --engines ...`` into ipyparallel's ``Cluster(engines=...)`` and its
launcher's settings. What nbtool adds is the torch.distributed world made of
whatever engines arrive: ``place`` orders them by host (the host of the
launcher's first rank is node 0), then by the launcher's own rank of each
process (Slurm's, MPI's) or the engine's registration; ``Place.rank_kwargs``
gives each its torchrun variables. One network interface is used for
everything: the controller listens on its address and gloo / nccl are told
its name (``network``).
"""
from __future__ import annotations

import os
import secrets
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

from .options import ClusterOptions, interface_address, interface_of
from .rank.bootstrap import boot_id


class LaunchError(RuntimeError):
    """The engines that arrived cannot form the world asked for."""

    def _render_traceback_(self):
        return [f"{type(self).__name__}: {self}"]


def network(opts: ClusterOptions) -> tuple[str | None, str]:
    """(interface name, controller address): loopback for local engines; else --interface's address,
    or the interface whose address reaches the first ssh host (a UDP socket's route: no packet sent),
    or the one holding this host name's address. ``--ip`` overrides the controller's address."""
    if not opts.multi_host and opts.interface is None:
        return None, opts.ip or "127.0.0.1"
    if opts.interface is not None:
        return opts.interface, opts.ip or interface_address(opts.interface)
    address = None
    if opts.hosts:
        host = opts.hosts[0][0].rpartition("@")[2]
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(host), 9))  # routing only: UDP connect sends nothing
                address = s.getsockname()[0]
        except OSError:
            address = None
    if address is None or address.startswith("127."):
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = None
    name = interface_of(address) if address else None
    if name is None:
        from IPython.core.error import UsageError

        raise UsageError("nbtool could not tell which network interface the hosts share; name it with "
                         "--interface NAME (ip -br addr lists them)")
    return name, opts.ip or address


def describe(opts: ClusterOptions) -> str:
    """The launcher in a few words, for progress lines and %cluster status."""
    if opts.profile is not None:
        return f"ipyparallel profile {opts.profile!r}"
    if opts.engines == "ssh":
        return "ssh: " + ", ".join(f"{h}:{k}" for h, k in opts.hosts)
    return {"local": "this machine", "slurm": "slurm", "mpi": "mpiexec"}[opts.engines]


def most_per_host(opts: ClusterOptions) -> int:
    """The most ranks one host gets (threads are split between them): --hosts' largest, else all."""
    return max(k for _, k in opts.hosts) if opts.hosts else opts.n


def cluster_kwargs(opts: ClusterOptions, ip: str) -> dict:
    """``ipyparallel.Cluster`` keywords for the launcher: its name, and its settings as config."""
    from traitlets.config import Config

    if opts.profile is not None:  # the profile's launcher and controller settings, as they are
        return {"profile": opts.profile, **({"controller_ip": opts.ip} if opts.ip else {})}
    cfg = Config()
    if opts.engines == "ssh":
        args = shlex.split(opts.ssh_args)
        cfg.SSHEngineSetLauncher.engines = {host: k for host, k in opts.hosts}
        cfg.SSHEngineSetLauncher.ssh_args = args
        cfg.SSHEngineSetLauncher.scp_args = args
        # the same Python on every host (a shared or identical environment), as nbtool's own ranks
        cfg.SSHEngineSetLauncher.remote_python = sys.executable
    elif opts.engines == "slurm":
        cfg.SlurmEngineSetLauncher.submit_command = ["sbatch", *shlex.split(opts.slurm_args)]
        # the batch script: not in the notebook's directory (ipyparallel's default), which is the job's
        cfg.SlurmEngineSetLauncher.batch_file_name = batch_file()
        cfg.SlurmEngineSetLauncher.engine_cmd = [sys.executable, "-m", "ipyparallel.engine"]
    elif opts.engines == "mpi":
        cfg.MPIEngineSetLauncher.engine_cmd = [sys.executable, "-m", "ipyparallel.engine"]
        if os.geteuid() == 0:  # Open MPI refuses root unless told twice
            cfg.MPIEngineSetLauncher.mpi_args = ["--allow-run-as-root", "--oversubscribe"]
    # an engine whose controller is gone (the kernel killed outright) shuts itself down after 20
    # missed pings (30 s); ipyparallel's default is 50
    for launcher in ("SSHEngineSetLauncher", "SlurmEngineSetLauncher", "MPIEngineSetLauncher"):
        cfg[launcher].engine_args = ["--IPEngine.max_heartbeat_misses=20"]
    # a host lost takes its engines' nannies with it, so only the controller's heartbeat can tell:
    # 1 s pings, 5 missed (ipyparallel's default is 3 s x 10: half a minute)
    beat = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=5"] if opts.multi_host else []
    return {"engines": opts.engines, "controller_ip": ip, "config": cfg, "load_profile": False,
            "controller_args": beat}


def submit_error(opts: ClusterOptions) -> str | None:
    """sbatch's own words for a refused submission (ipyparallel lets its stderr go to the terminal):
    the same options checked again with ``sbatch --test-only``, which submits nothing."""
    if opts.engines != "slurm":
        return None
    try:
        r = subprocess.run(["sbatch", "--test-only", *shlex.split(opts.slurm_args), "--wrap", "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [x for x in r.stderr.splitlines() if "error" in x.lower()]
    return lines[-1] if r.returncode and lines else None


def launch_failure(cluster) -> str | None:
    """The last lines of an engine launcher's output once its process has exited (mpiexec, ssh),
    or None while it runs. Batch launchers (Slurm) exit at submission: their job is watched instead."""
    for engine_set in cluster.engines.values():
        if getattr(engine_set, "job_id", None) or getattr(engine_set, "state", "") != "after":
            continue
        try:
            out = engine_set.get_output() or ""
        except Exception:
            out = ""
        lines = [line for line in out.splitlines() if line.strip()][-6:]
        return "\n".join(lines) or "(no output)"
    return None


def batch_file() -> str:
    """Where this kernel's engines' Slurm batch script is written (removed by RankCluster.stop)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"nbtool-engines-{os.getpid()}.sbatch")


@dataclass(frozen=True)
class Place:
    """Where one rank runs: its host (name, and address on the shared interface), node and local rank."""

    host: str
    address: str | None
    node_rank: int
    local_rank: int
    local_world_size: int
    boot_id: str | None
    pid: int

    @property
    def label(self) -> str:
        return self.host if self.address in (None, self.host) else f"{self.host} ({self.address})"

    def rank_kwargs(self, ifname: str | None) -> dict:
        return {"local_rank": self.local_rank, "local_world_size": self.local_world_size,
                "node_rank": self.node_rank, "ifname": ifname}


def place(facts: dict, opts: ClusterOptions, ifname: str | None) -> tuple[list[int], list[Place]]:
    """Engine ids in rank order and each rank's Place, from bootstrap.host_facts per engine id.

    A host is its address on the shared interface (network namespaces of one machine share a host
    name), else its name. Hosts are ordered by the launcher's first rank on each (Slurm's, MPI's), or
    by --hosts' order, or by first registration; ranks within a host likewise.
    """
    missing = [f"{f['hostname']} (engine {eid}; it has {', '.join(f['interfaces'])})"
               for eid, f in facts.items() if ifname and not f["address"]]
    if missing:
        raise LaunchError(f"--interface {ifname}: no IPv4 address on {', '.join(missing)}; name an interface "
                          "every host has (the same name on each)")

    def key(eid):
        f = facts[eid]
        return (f["launcher_rank"] if f["launcher_rank"] is not None else eid, eid)

    hosts: dict = {}
    for eid in sorted(facts, key=key):
        f = facts[eid]
        hosts.setdefault(f["address"] or f["hostname"], []).append(eid)
    order = list(hosts)
    if opts.hosts:  # ssh: node ranks follow --hosts, whatever order the engines registered in
        given = [_resolve(h.rpartition("@")[2]) for h, _ in opts.hosts]
        order.sort(key=lambda h: given.index(h) if h in given else len(given))
    ids, places = [], []
    for node, h in enumerate(order):
        for local, eid in enumerate(hosts[h]):
            f = facts[eid]
            ids.append(eid)
            places.append(Place(f["hostname"], f["address"], node, local, len(hosts[h]), f["boot_id"], f["pid"]))
    return ids, places


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def store_path(opts: ClusterOptions, own_dir: str, places: list[Place]) -> str | None:
    """Where the ranks meet: a FileStore path (the owner-only directory on one machine, or
    --rendezvous file:DIR), or None for rank 0's TCP store (--rendezvous tcp; the default when the
    engines are on more than one machine and no directory was named)."""
    if opts.rendezvous and opts.rendezvous.startswith("file:"):
        # a fresh name per start: a restart must not meet the previous world's leftover store file
        return os.path.join(opts.rendezvous[5:], f"nbtool-rendezvous-{os.getpid()}-{secrets.token_hex(4)}")
    one_machine = len({p.boot_id for p in places}) == 1 and places[0].boot_id == boot_id()
    if opts.rendezvous == "tcp" or not one_machine:
        return None
    return os.path.join(own_dir, "rendezvous")


def hosts_text(places: list[Place], ranks=None) -> str:
    """``node0 (10.0.0.1): ranks 0-1; node1 (10.0.0.2): ranks 2-3`` for ``ranks`` (default: all)."""
    from .options import format_ranks

    by: dict = {}
    for rank in range(len(places)) if ranks is None else ranks:
        p = places[rank]
        by.setdefault((p.node_rank, p.label), []).append(rank)
    return "; ".join(f"{label}: rank{'s' if len(r) > 1 else ''} {format_ranks(r)}" for (_, label), r in sorted(by.items()))


@dataclass(frozen=True)
class JobState:
    """One look at a Slurm job: its JobState and Reason."""

    state: str
    reason: str = "None"
    ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "RESIZING", "REQUEUED")
    # pending reasons that no wait cures: the request exceeds what the partition or the site allows
    NEVER = ("PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
             "InvalidQOS", "QOSMaxNodePerJobLimit", "AssocMaxNodesPerJob", "ReqNodeNotAvail")

    @property
    def pending(self) -> str | None:
        """``pending (Resources)`` while queued, else None."""
        if self.state != "PENDING":
            return None
        return "pending" + (f" ({self.reason})" if self.reason != "None" else "")

    @property
    def never(self) -> str | None:
        """The reason when the job is pending for good (see NEVER), else None."""
        return self.reason if self.state == "PENDING" and self.reason.startswith(self.NEVER) else None

    @property
    def gone(self) -> bool:
        """The job ended (cancelled, failed, preempted ...) or Slurm forgot it."""
        return self.state not in self.ACTIVE

    def __str__(self) -> str:
        return self.state + (f" ({self.reason})" if self.reason != "None" else "")


class SlurmJob:
    """The engines' Slurm job: its id, state and reason (scontrol, squeue), for progress, faults and stop."""

    def __init__(self, job_id: str):
        self.id = job_id

    @classmethod
    def of(cls, cluster) -> "SlurmJob | None":
        for engine_set in cluster.engines.values():
            job = getattr(engine_set, "job_id", None)
            if job:
                return cls(str(job))
        return None

    def look(self) -> "JobState":
        """The job's state and reason now, from one ``scontrol show job`` ("ended" once Slurm has
        forgotten it)."""
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return JobState("ended")
        fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
        return JobState(fields["JobState"], fields.get("Reason", "None")) if "JobState" in fields else JobState("ended")

    def in_queue(self) -> bool:
        try:
            out = subprocess.run(["squeue", "-h", "-j", self.id], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return bool(out.stdout.strip())

    def wait_gone(self, timeout: float = 30.0) -> bool:
        """Wait (bounded) until the job has left squeue; True when it has."""
        import time

        deadline = time.monotonic() + timeout
        while self.in_queue():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True
