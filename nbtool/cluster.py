"""The kernel's handle on a running cluster: ipyparallel lifecycle, rank map, health.

One ``RankCluster`` owns one ipyparallel controller and N engines; engine i
(in registration order) is torch.distributed rank i for the engines' whole
life. Nothing here parses magic lines or draws anything: callers pass a
``progress`` callable to hear what is happening.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import ipyparallel as ipp

from .devices import physical_visible_devices, visible_gpu_count
from .options import ClusterOptions, Layout, label_ranks, resolve_layout
from . import launchers
from .rank import bootstrap

Progress = Callable[[str], None]

# ipyparallel logs engine output and exit codes to stdout at WARNING when a
# cluster stops; keep that out of notebooks (a logging config of the user still sees it).
_log = logging.getLogger("nbtool.ipyparallel")
_log.addHandler(logging.NullHandler())


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (start, reach a rank ...)."""

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [f"{type(self).__name__}: {self}"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(n: int) -> int:
    """Split the cores between ranks so they do not oversubscribe the CPU."""
    return max(1, (os.cpu_count() or 1) // n)


@dataclass(frozen=True)
class GroupClosed:
    """Why the process group can no longer run collectives (until ``%cluster restart``)."""

    class Cause(enum.Enum):
        RELEASED = "closed to release ranks blocked in a collective"
        UNRESPONSIVE = "an engine stopped responding"
        RANK_DIED = "a rank died"

    cause: "GroupClosed.Cause"
    text: str  # what the user reads

    RELEASED = Cause.RELEASED
    UNRESPONSIVE = Cause.UNRESPONSIVE
    RANK_DIED = Cause.RANK_DIED

    def __str__(self) -> str:
        return self.text


class RankCluster:
    """N ipyparallel engines that are ranks 0..N-1 of one process group."""

    def __init__(self, options: ClusterOptions, layout: Layout):
        self.options = options
        self.layout = layout
        self._cluster: ipp.Cluster | None = None
        self.client: ipp.Client | None = None
        self.engine_ids: list[int] = []  # index = rank
        self._views: dict[tuple[int, ...], ipp.DirectView] = {}
        self.started_s: float | None = None
        self.pids: list[int] = []  # engine process per rank
        # why the process group can no longer run collectives (None: it can)
        self.group_closed: GroupClosed | None = None
        self.collective_timeout: float = options.collective_timeout  # what the engines use now
        self._store_dir: str | None = None
        self.last_hang = None  # the watchdog's last HangReport (nbtool.faults)
        self.places: list = []  # launchers.Place per rank: host, node rank, local rank
        self.ifname: str | None = None  # the interface the hosts share (None: loopback, one machine)
        self.slurm_job: str | None = None  # the engines' Slurm job id under --engines slurm
        self._job = None  # its launchers.SlurmJob

    # -- lifecycle -------------------------------------------------------
    @classmethod
    def start(cls, options: ClusterOptions, progress: Progress = lambda m: None) -> "RankCluster":
        """Start engines and make them a process group; raises ClusterError."""
        layout = resolve_layout(options, visible_gpu_count())
        self = cls(options, layout)
        self._start_or_stop(progress)
        return self

    def _start_or_stop(self, progress: Progress) -> None:
        """Start, or leave nothing running when starting fails."""
        try:
            self._start(progress)
        except BaseException:
            self.stop()
            raise

    def _start(self, progress: Progress) -> None:
        t0 = time.perf_counter()
        n, timeout = self.layout.n, self.options.timeout
        deadline = t0 + timeout
        self.group_closed = None
        self.collective_timeout = self.options.collective_timeout
        # the ranks' rendezvous file lives here, readable by this user only (mkdtemp: 0700)
        self._store_dir = tempfile.mkdtemp(prefix="nbtool-")
        self.ifname, ip = launchers.network(self.options)
        self.slurm_job = None
        progress(f"starting {n} engine(s) ({launchers.describe(self.options)}) ...")
        self._cluster = ipp.Cluster(
            n=n,
            # engines wait for the controller's connection info themselves
            delay=0,
            engine_timeout=int(timeout),
            log=_log,
            shutdown_atexit=True,
            **launchers.cluster_kwargs(self.options, ip),
        )
        env = {"OMP_NUM_THREADS": str(threads_per_rank(n if not self.options.multi_host else
                                                           launchers.most_per_host(self.options)))}
        if self.layout.device_kind == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        self._cluster.start_controller_sync()
        try:
            self._cluster.start_engines_sync(n, environment=env)
        except Exception as e:  # sbatch refusing the job, ssh unable to reach a host ...
            said = (getattr(e, "stderr", None) or getattr(e, "output", None) or b"")
            said = said.decode(errors="replace") if isinstance(said, bytes) else str(said)
            said = launchers.submit_error(self.options) or said
            raise ClusterError(f"the {launchers.describe(self.options)} launcher could not start the engines: "
                               f"{(said.strip() or str(e)).splitlines()[-1]}") from None
        self.client = self._cluster.connect_client_sync()
        waiting = self.client.wait_for_engines(n, block=False, timeout=timeout, interactive=False)
        seen = -1
        job = self._job = launchers.SlurmJob.of(self._cluster)
        while not waiting.done():
            now = len(self.client.ids)
            look = job.look() if job is not None else None  # one scontrol call per tick
            queued = look.pending if look is not None else None
            if queued:
                progress(f"slurm job {job.id} {queued} ...")
            elif now != seen:
                progress(f"engines connected: {now}/{n}")
                seen = now
            if look is not None and look.gone:
                raise ClusterError(f"slurm job {job.id} ended before its engines connected: {look}")
            never = look.never if look is not None else None
            if never:
                raise ClusterError(f"slurm job {job.id} cannot start: pending ({never}), a request this "
                                   "partition never grants; it was cancelled")
            ended = launchers.launch_failure(self._cluster)
            if ended and len(self.client.ids) < n:
                raise ClusterError(f"the {launchers.describe(self.options)} engine launcher exited with "
                                   f"{now} of {n} engines connected; its output ends:\n{ended}")
            if time.perf_counter() > deadline:
                missing = f"slurm job {job.id} still {queued}" if queued else f"{n - now} engine(s) never connected"
                raise ClusterError(f"only {now} of {n} engines connected within --timeout {timeout:g}s; "
                                   f"{missing}")
            time.sleep(0.05 if job is None else 0.5)
        waiting.result()
        self.slurm_job = job.id if job is not None else None
        self.engine_ids, self.places = self._place_ranks(sorted(self.client.ids)[:n])
        progress(f"engines connected: {n}/{n}; initialising process group ({self.layout.backend}) ...")
        self._init_process_group(deadline)
        self.started_s = time.perf_counter() - t0
        progress(f"ready: {n} rank(s), backend {self.layout.backend}, "
                 f"{'GPUs ' + ','.join(map(str, self.layout.gpus)) if self.layout.gpus else 'CPU'} "
                 f"({self.started_s:.1f} s)")

    def _place_ranks(self, engine_ids: list[int]) -> tuple[list[int], list[launchers.Place]]:
        """Engines in rank order (by host, then the launcher's own order) and where each runs."""
        facts = {eid: self.client[eid].apply_async(bootstrap.host_facts, self.ifname) for eid in engine_ids}
        got = {}
        for eid, ar in facts.items():
            try:
                got[eid] = ar.get(timeout=max(5.0, self.options.timeout / 4))
            except Exception as e:
                raise ClusterError(f"engine {eid} did not say where it runs: {e}") from None
        return launchers.place(got, self.options, self.ifname)

    def _init_process_group(self, deadline: float) -> None:
        n = self.layout.n
        places = self.places
        multi = self.options.multi_host
        master = places[0].address if multi else "127.0.0.1"
        # a TCP store listens on rank 0's machine: a port free there
        port = free_port() if not multi else self.client[self.engine_ids[0]].apply_sync(bootstrap.free_port, master)
        devices = physical_visible_devices(list(self.layout.gpus)) if self.layout.gpus else None
        controller_pid = getattr(getattr(self._cluster.controller, "process", None), "pid", None)
        # removed by the engines if the kernel dies without stopping the cluster
        cleanup = (self._store_dir, getattr(self._cluster, "cluster_file", None))
        store = launchers.store_path(self.options, self._store_dir, places)
        if self.options.rendezvous and store:
            self.check_shared(os.path.dirname(store), "--rendezvous")
        mine = bootstrap.boot_id()
        pending = [
            self.client[eid].apply_async(
                bootstrap.init_rank,
                rank=rank,
                world_size=n,
                master_addr=master,
                master_port=port,
                backend=self.layout.backend,
                visible_devices=devices,
                num_threads=threads_per_rank(places[rank].local_world_size if multi else n),
                timeout_s=self.options.timeout,
                # only engines on this machine can watch the kernel's and controller's processes
                kernel_pid=os.getpid() if places[rank].boot_id == mine else None,
                controller_pid=controller_pid,
                store_path=store,
                collective_timeout_s=self.collective_timeout,
                cleanup_paths=tuple(p for p in cleanup if p) if places[rank].boot_id == mine else (),
                **(places[rank].rank_kwargs(self.ifname) if multi else {}),
            )
            for rank, eid in enumerate(self.engine_ids)
        ]
        self.pids = []
        for rank, ar in enumerate(pending):
            left = max(0.1, deadline - time.perf_counter())
            try:
                self.pids.append(ar.get(timeout=left)["pid"])
            except ipp.error.TimeoutError:
                raise ClusterError(
                    f"rank {rank} did not join the {self.layout.backend} process group "
                    f"within --timeout {self.options.timeout:g}s"
                ) from None
            except ipp.error.RemoteError as e:
                raise ClusterError(f"rank {rank} failed to initialise: {e.ename}: {e.evalue}") from None

    def check_shared(self, directory: str, what: str) -> None:
        """Refuse a directory some rank's host does not see: rank 0 writes a file in it (making the
        directory), every rank looks for it; a ClusterError names the hosts that do not see it."""
        ranks = list(range(self.layout.n))
        token = f"{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.view([0]).apply_async(bootstrap.shared_probe, directory, token, True).get(timeout=30)
            seen = self.view(ranks).apply_async(bootstrap.shared_probe, directory, token, False).get(timeout=30)
        except ipp.error.RemoteError as e:
            raise ClusterError(f"{what} {directory}: rank 0 cannot write there: {e.evalue}") from None
        finally:
            with contextlib.suppress(Exception):
                self.view([0]).apply_async(bootstrap.shared_probe, directory, token, None).get(timeout=30)
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            raise ClusterError(f"{what} {directory}: not shared with every host; "
                               f"{launchers.hosts_text(self.places, blind)} do not see it. "
                               "Name a directory on a filesystem every host mounts")

    def restart(self, progress: Progress = lambda m: None) -> None:
        """Fresh engines and process group with the same options, in this object."""
        self.stop()
        self._start_or_stop(progress)

    def stop(self) -> None:
        """Stop engines and controller; safe to call twice."""
        cluster, self._cluster = self._cluster, None
        client, self.client = self.client, None
        self._views.clear()
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if cluster is not None:
            # the controller and its scheduler processes, to be sure none outlives a failed start
            tree = _process_tree(getattr(cluster.controller, "process", None))
            # ipyparallel starts the controller as a session leader: its process group also holds the
            # schedulers it forks, which a SIGTERM arriving mid-start orphans after the snapshot above
            group = getattr(getattr(cluster.controller, "process", None), "pid", None)
            # engines and controller apart: a launcher that fails to stop (an ssh host gone) must not
            # leave the controller running
            for stop in (cluster.stop_engines_sync, cluster.stop_controller_sync):
                with contextlib.suppress(Exception):
                    stop()
            job, self._job = self._job, None
            if job is not None:  # scancel'd by the launcher: return once Slurm has let go of it
                job.wait_gone()
            if self.options.engines == "slurm":
                with contextlib.suppress(OSError):
                    os.unlink(launchers.batch_file())
            # stop_cluster signals the processes; wait so none outlives the call
            for launcher in [cluster.controller, *cluster.engines.values()]:
                _wait_launcher(launcher)
            # stopped: ipyparallel's own atexit/__del__ stop would run scancel or ssh again, later
            cluster.engines.clear()
            cluster.controller = None
            for p in tree:  # what stop_controller left (seen after a start sbatch refused)
                with contextlib.suppress(Exception):
                    p.kill()
            if group and _is_group_of(group, "ipyparallel"):
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def world_size(self) -> int:
        return self.layout.n

    # -- ranks -----------------------------------------------------------
    def view(self, ranks: list[int]) -> ipp.DirectView:
        """A non-blocking DirectView on ``ranks`` (cached: views are cheap to reuse)."""
        key = tuple(ranks)
        view = self._views.get(key)
        if view is None:
            view = self.client.direct_view(targets=[self.engine_ids[r] for r in ranks])
            view.block = False
            self._views[key] = view
        return view

    def rank_of(self, engine_id: int) -> int:
        return self.engine_ids.index(engine_id)

    def lost_ranks(self) -> list[int]:
        """Ranks whose engine is no longer registered with the controller."""
        alive = set(self.client.ids) if self.client is not None else set()
        return [r for r, eid in enumerate(self.engine_ids) if eid not in alive]

    def where(self, rank: int) -> str:
        """`` on HOST (ADDRESS)`` for a rank of a cluster of machines, else ''."""
        if not self.options.multi_host or rank >= len(self.places):
            return ""
        return f" on {self.places[rank].label}"

    def lost_text(self) -> str:
        """The lost ranks, by host on a cluster of machines (``vm (10.0.0.2): rank 1``)."""
        lost = self.lost_ranks()
        if not self.options.multi_host or not self.places:
            return label_ranks(lost)
        job = launchers.SlurmJob(self.slurm_job) if self.slurm_job else None
        return launchers.hosts_text(self.places, lost) + (f" (slurm job {job.id} {job.look().state})" if job else "")

    def exit_reason(self, rank: int) -> str:
        """How rank's engine ended (see _exit_reason), and its Slurm job's state under --engines slurm."""
        reason = self._exit_reason(rank)
        if self.slurm_job:
            reason += f"; slurm job {self.slurm_job} {launchers.SlurmJob(self.slurm_job).look()}"
        return reason

    def _exit_reason(self, rank: int) -> str:
        """How rank's engine process ended, as far as can be known.

        ipyparallel's launcher reaps the process on a thread and reports the
        exit code only through its event loop, so the code is often unknown;
        the engine's log then tells a native crash (faulthandler's report)
        from a process that vanished without one (a signal such as SIGKILL).
        """
        if self.options.multi_host and rank < len(self.places) and self.places[rank].boot_id != bootstrap.boot_id():
            return "its engine stopped answering the controller (killed, or its host or the network to it lost)"
        code = (getattr(self._launcher(rank), "stop_data", None) or {}).get("exit_code")
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        if code is not None:
            return f"exited with code {code}"
        tail = _tail(self.log_file(rank))
        for marker, what in (("Segmentation fault", "crashed: segmentation fault in native code"),
                             ("Fatal Python error: Aborted", "crashed: abort() in native code"),
                             ("Bus error", "crashed: bus error in native code"),
                             ("Fatal Python error", "crashed: fatal Python error")):
            if marker in tail:
                return what + " (the Python stack is in its log)"
        return ("its process vanished without a Python error: killed by a signal "
                "(SIGKILL from kill -9 or the out-of-memory killer) or os._exit")

    def log_file(self, rank: int) -> str | None:
        """The engine's own log (its stderr: faulthandler stacks, native errors)."""
        return getattr(self._launcher(rank), "output_file", None)

    def _launcher(self, rank: int):
        """ipyparallel's launcher of rank's engine process (matched by pid), or None."""
        pid = self.pids[rank] if rank < len(self.pids) else None
        if self._cluster is None or pid is None:
            return None
        for engine_set in self._cluster.engines.values():
            for launcher in getattr(engine_set, "launchers", {}).values():
                if getattr(launcher, "pid", None) == pid:
                    return launcher
        return None

    def close_group(self, ranks: list[int], reason: str, timeout: float = 5.0) -> None:
        """Tear down the process group on idle ``ranks`` (see bootstrap.close_process_group).

        Each idle rank also shuts down its TCP connections to the other ranks'
        processes (found in the OS's socket tables), so a peer blocked in a
        gloo collective gets end-of-file at once even while a DDP model or a
        DeviceMesh in its namespace keeps the group object alive.
        """
        self.group_closed = GroupClosed(GroupClosed.RELEASED, reason)
        for r in ranks:
            with contextlib.suppress(Exception):
                self.view([r]).apply_async(bootstrap.close_process_group, self.peer_sockets(r)).get(timeout=timeout)

    def peer_sockets(self, rank: int) -> list[int]:
        """File descriptors of rank's TCP connections whose other end is another rank's process."""
        import psutil

        conns = {}
        for r, pid in enumerate(self.pids):
            try:
                conns[r] = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.Error:
                conns[r] = []
        others = {tuple(c.laddr) for r, cs in conns.items() if r != rank for c in cs if c.laddr}
        return sorted({c.fd for c in conns.get(rank, []) if c.raddr and tuple(c.raddr) in others and c.fd >= 0})

    def set_collective_timeout(self, seconds: float) -> None:
        """Tell every live engine's watchdog the per-collective timeout (only when it changes)."""
        if seconds == self.collective_timeout:
            return
        from .rank import watchdog

        lost = set(self.lost_ranks())
        alive = [r for r in range(self.world_size) if r not in lost]
        self.view(alive).apply_sync(watchdog.configure, seconds)
        self.collective_timeout = seconds

    def signal(self, ranks: list[int], sig: str = "SIGINT") -> None:
        """Deliver a signal to the ranks' engine processes (through their nannies)."""
        self.client.send_signal(sig, targets=[self.engine_ids[r] for r in ranks], block=True)

    def status(self, timeout: float = 5.0) -> list[dict]:
        """One row per rank; ranks that do not answer in ``timeout`` say why."""
        alive = set(self.client.ids)
        rows: list[dict] = []
        pending = {}
        for rank, eid in enumerate(self.engine_ids):
            if eid in alive:
                pending[rank] = self.client[eid].apply_async(bootstrap.rank_info)
            else:
                rows.append({"rank": rank, "engine_id": eid, "state": "lost"})
        deadline = time.perf_counter() + timeout
        for rank, ar in pending.items():
            row = {"rank": rank, "engine_id": self.engine_ids[rank]}
            try:
                row.update(ar.get(timeout=max(0.05, deadline - time.perf_counter())))
                row["state"] = "ready"
            except ipp.error.TimeoutError:
                row["state"] = "busy or hung"
            except ipp.error.RemoteError as e:
                row["state"] = f"error: {e.ename}"
            rows.append(row)
        return sorted(rows, key=lambda r: r["rank"])


def _process_tree(proc) -> list:
    """psutil handles of ``proc`` (a Popen or psutil.Process, or None) and its descendants."""
    import psutil

    pid = getattr(proc, "pid", None)
    if not pid:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _is_group_of(pgid: int, marker: str) -> bool:
    """Whether some live process in group ``pgid`` runs ``marker`` (a pid reused by a stranger's
    group since must not be signalled)."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid and marker in " ".join(p.info["cmdline"] or ()):
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _tail(path: str | None, nbytes: int = 4096) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _wait_launcher(launcher, timeout: float = 10.0) -> None:
    # a launcher's own process, and those of the launchers it holds (an engine set's)
    procs = [getattr(x, "process", None) for x in (launcher, *getattr(launcher, "launchers", {}).values())]
    deadline = time.perf_counter() + timeout
    for p in filter(None, procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except Exception:
            with contextlib.suppress(Exception):
                p.kill()
