"""The kernel's handle on a running cluster: ipyparallel lifecycle, rank map, health.

One ``RankCluster`` owns one ipyparallel controller and N engines; engine i
(in registration order) is torch.distributed rank i for the engines' whole
life. Nothing here parses magic lines or draws anything: callers pass a
``progress`` callable to hear what is happening.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import ipyparallel as ipp

from .devices import physical_visible_devices, visible_gpu_count
from .options import ClusterOptions, Layout, resolve_layout
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

    # -- lifecycle -------------------------------------------------------
    @classmethod
    def start(cls, options: ClusterOptions, progress: Progress = lambda m: None) -> "RankCluster":
        """Start engines and make them a process group; raises ClusterError."""
        layout = resolve_layout(options, visible_gpu_count())
        self = cls(options, layout)
        try:
            self._start(progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, progress: Progress) -> None:
        t0 = time.perf_counter()
        n, timeout = self.layout.n, self.options.timeout
        deadline = t0 + timeout
        progress(f"starting {n} engine(s) ...")
        self._cluster = ipp.Cluster(
            n=n,
            controller_ip="127.0.0.1",
            # engines wait for the controller's connection info themselves
            delay=0,
            engine_timeout=int(timeout),
            log=_log,
            shutdown_atexit=True,
        )
        env = {"OMP_NUM_THREADS": str(threads_per_rank(n))}
        if not self.layout.gpus:
            env["DS_ACCELERATOR"] = "cpu"
        self._cluster.start_controller_sync()
        self._cluster.start_engines_sync(n, environment=env)
        self.client = self._cluster.connect_client_sync()
        waiting = self.client.wait_for_engines(n, block=False, timeout=timeout, interactive=False)
        seen = -1
        while not waiting.done():
            now = len(self.client.ids)
            if now != seen:
                progress(f"engines connected: {now}/{n}")
                seen = now
            if time.perf_counter() > deadline:
                raise ClusterError(
                    f"only {len(self.client.ids)} of {n} engines connected within --timeout {timeout:g}s"
                )
            time.sleep(0.05)
        waiting.result()
        self.engine_ids = sorted(self.client.ids)[:n]
        progress(f"engines connected: {n}/{n}; initialising process group ({self.layout.backend}) ...")
        self._init_process_group(deadline)
        self.started_s = time.perf_counter() - t0
        progress(
            f"ready: {n} rank(s), backend {self.layout.backend}, "
            f"{'GPUs ' + ','.join(map(str, self.layout.gpus)) if self.layout.gpus else 'CPU'} "
            f"({self.started_s:.1f} s)"
        )

    def _init_process_group(self, deadline: float) -> None:
        n = self.layout.n
        port = free_port()
        devices = physical_visible_devices(list(self.layout.gpus)) if self.layout.gpus else None
        controller_pid = getattr(getattr(self._cluster.controller, "process", None), "pid", None)
        pending = [
            self.client[eid].apply_async(
                bootstrap.init_rank,
                rank=rank,
                world_size=n,
                master_addr="127.0.0.1",
                master_port=port,
                backend=self.layout.backend,
                visible_devices=devices,
                num_threads=threads_per_rank(n),
                timeout_s=self.options.timeout,
                kernel_pid=os.getpid(),
                controller_pid=controller_pid,
            )
            for rank, eid in enumerate(self.engine_ids)
        ]
        for rank, ar in enumerate(pending):
            left = max(0.1, deadline - time.perf_counter())
            try:
                ar.get(timeout=left)
            except ipp.error.TimeoutError:
                raise ClusterError(
                    f"rank {rank} did not join the {self.layout.backend} process group "
                    f"within --timeout {self.options.timeout:g}s"
                ) from None
            except ipp.error.RemoteError as e:
                raise ClusterError(f"rank {rank} failed to initialise: {e.ename}: {e.evalue}") from None

    def stop(self) -> None:
        """Stop engines and controller; safe to call twice."""
        cluster, self._cluster = self._cluster, None
        client, self.client = self.client, None
        self._views.clear()
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
        if cluster is not None:
            try:
                cluster.stop_cluster_sync()
            except Exception:
                pass
            # stop_cluster signals the processes; wait so none outlives the call
            for launcher in [cluster.controller, *cluster.engines.values()]:
                _wait_launcher(launcher)

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


def _wait_launcher(launcher, timeout: float = 10.0) -> None:
    proc = getattr(launcher, "process", None) if launcher is not None else None
    procs = [proc] if proc is not None else []
    for sub in getattr(launcher, "launchers", {}).values():
        if getattr(sub, "process", None) is not None:
            procs.append(sub.process)
    deadline = time.perf_counter() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except Exception:
            try:
                p.kill()
            except Exception:
                pass
