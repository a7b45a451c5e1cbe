"""Engine-side start-up: environment, device, threads and the process group.

Runs inside each ipyparallel engine (through ``view.apply``), once per engine
life. Nothing here imports IPython display or widget code.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta


def init_rank(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    visible_devices: str | None,
    num_threads: int,
    timeout_s: float,
    kernel_pid: int | None = None,
    controller_pid: int | None = None,
    store_path: str | None = None,
    collective_timeout_s: float | None = None,
    cleanup_paths: tuple = (),
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int = 0,
    ifname: str | None = None,
) -> dict:
    """Make this engine rank ``rank`` of a ``world_size`` process group.

    Sets the torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) before importing torch, so libraries that read
    them (DeepSpeed, FSDP helpers) see a normal launch. ``visible_devices`` is
    the CUDA_VISIBLE_DEVICES value shared by all ranks (None on CPU ranks);
    rank i uses cuda:i of those, as with torchrun.

    With ``store_path`` the ranks meet through a FileStore in that (owner-only)
    directory instead of a TCPStore, which would listen on every interface.

    On a cluster of hosts (``local_rank`` given) rank is global, ``local_rank``
    its index on its host (also NODE_RANK's GPU: cuda:local_rank of what the
    launcher left visible; ``visible_devices`` is then None and
    CUDA_VISIBLE_DEVICES is kept), and ``ifname`` the interface gloo and nccl
    use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
    The hang watchdog (``watchdog.install``) and faulthandler (a segfault's
    Python stack goes to the engine's log) are set up here too.
    """
    hosts = local_rank is not None
    local = rank if not hosts else local_rank
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(world_size if not hosts else local_world_size),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ifname
    # OMP_NUM_THREADS and DS_ACCELERATOR are in the engine's environment from its launch
    # (RankCluster.start): they must be there before torch or deepspeed is first imported
    if not hosts:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices or ""
    os.environ.update(env)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    if visible_devices or (hosts and backend == "nccl"):
        need = world_size if not hosts else local_world_size
        if torch.cuda.device_count() < need:
            raise RuntimeError(
                f"rank {rank}: needs {need} GPUs on {socket.gethostname()} but torch sees "
                f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
            )
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        kwargs = dict(
            backend=backend,
            init_method=f"file://{store_path}" if store_path else f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        if backend == "nccl":
            kwargs["device_id"] = device
            from ..flight_recorder import enable

            enable(os.environ)  # hang reports read each rank's NCCL flight recorder
        dist.init_process_group(**kwargs)

    import faulthandler

    from . import watchdog

    faulthandler.enable(file=sys.__stderr__)  # the engine's real stderr: ipyparallel's log file
    pin_none()
    watchdog.install(rank, collective_timeout_s or watchdog.DEFAULT_TIMEOUT_S)
    _install_namespace(rank, world_size, device)
    if kernel_pid:
        _watch_kernel(kernel_pid, controller_pid, tuple(cleanup_paths))
    return rank_info()


def close_process_group(peer_fds: list[int] = ()) -> str:
    """Tear down this rank's process group so peers blocked in a collective with it fail at once.

    Used by the kernel to release ranks stuck in a collective that an
    interrupt cannot reach (a rank that raised, finished or skipped it is
    idle). The group cannot be made again in this engine (DeepSpeed caches
    groups): the cluster needs ``%cluster restart`` for further collectives.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return "not initialised"
    # destroy_process_group only drops torch's own references: a DDP model, a
    # DeviceMesh or DeepSpeed still holding a group keeps its sockets open and
    # the peer stays blocked. Aborting each backend closes them whoever holds it.
    for pg in list(c10d._world.pg_map):
        for device in (torch.device("cpu"), torch.device("cuda")):
            with contextlib.suppress(Exception):  # no backend for that device type, or already closed
                pg._get_backend(device).abort()
    dist.destroy_process_group()
    _shutdown_sockets(peer_fds)
    return "closed"


def _shutdown_sockets(fds) -> None:
    """shutdown() the given TCP sockets (the kernel found them connected to peer ranks).

    shutdown acts on the connection, not the descriptor, so it reaches the
    peer (end-of-file) even though gloo keeps its own descriptor open.
    """
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s, contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _install_namespace(rank: int, world_size: int, device) -> None:
    """Names every ``%%distributed`` cell can use without importing them."""
    import torch
    import torch.distributed as dist

    from IPython import get_ipython  # the engine's own shell, not display code

    shell = get_ipython()
    if shell is None:  # plain apply outside an engine (unit use)
        return
    shell.user_ns.update(torch=torch, dist=dist, rank=rank, world_size=world_size, device=device)


def rank_device():
    """This rank's device: its GPU when the rank was given one (CUDA_VISIBLE_DEVICES), else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port(address: str) -> int:
    """A TCP port free on this machine at ``address`` (for rank 0's TCP store)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def shared_probe(directory: str, token: str, write: bool | None) -> bool:
    """Is ``directory`` one filesystem for every rank: write (True) a marker named by ``token``,
    look for it (False), or remove it (None)."""
    marker = os.path.join(os.path.abspath(directory), f".nbtool-shared-{token}")
    if write:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w"):
            pass
        return True
    if write is None:
        if os.path.exists(marker):
            os.unlink(marker)
        return True
    return os.path.exists(marker)


def host_facts(ifname: str | None) -> dict:
    """Where this engine runs, before it is a rank: host name, its address on ``ifname``, the machine's
    boot id (equal boot ids: one machine, whatever the network namespace), and the launcher's own
    rank of this process (Slurm's, MPI's) when it has one."""
    import psutil

    addrs = psutil.net_if_addrs()
    address = next((a.address for a in addrs.get(ifname or "", []) if a.family == socket.AF_INET), None)
    launcher_rank = next((int(os.environ[k]) for k in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                        "PMIX_RANK") if os.environ.get(k, "").isdigit()), None)
    return {"hostname": socket.gethostname(), "address": address, "boot_id": boot_id(), "pid": os.getpid(),
            "launcher_rank": launcher_rank, "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "interfaces": sorted(addrs)}


def boot_id() -> str | None:
    """This machine's boot id: engines with the same one share its processes (whatever their network)."""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return None


def rank_info() -> dict:
    """Facts about this rank for ``%cluster status``."""
    import psutil
    import torch
    import torch.distributed as dist

    mem = psutil.Process().memory_info()
    initialized = dist.is_available() and dist.is_initialized()
    device = "cpu"
    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES"):
        idx = torch.cuda.current_device()
        device = f"cuda:{idx} ({torch.cuda.get_device_name(idx)})"
    return {
        "rank": dist.get_rank() if initialized else int(os.environ.get("RANK", -1)),
        "world_size": dist.get_world_size() if initialized else None,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "node_rank": int(os.environ.get("NODE_RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "device": device,
        "backend": dist.get_backend() if initialized else None,
        "rss_bytes": mem.rss,
        "peak_rss_bytes": rss()[1],
        "threads": torch.get_num_threads(),
    }


def rss() -> tuple[int, int | None]:
    """(current RSS, peak RSS) of this process in bytes: Linux's VmRSS / VmHWM, else psutil (no peak)."""
    with contextlib.suppress(OSError):
        cur = peak = None
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
        if cur is not None:
            return cur, peak
    import psutil

    return psutil.Process().memory_info().rss, None


_watcher: threading.Thread | None = None


NONE_PIN = 1 << 40


def pin_none() -> None:
    """Make None immortal before Python 3.12 (which does it for every immortal object).

    Some C extension code hands out None without taking a reference, so each
    call lowers None's count for good; at zero the process aborts with "Fatal
    Python error: none_dealloc". torch 2.13's profiler does it (here about 13k
    per ``fsdp --memory-timeline`` cell on 2 ranks), so an engine died after
    about 9 such cells. 2**40 is more than any session can lose.
    """
    if sys.version_info < (3, 12) and sys.getrefcount(None) < NONE_PIN:
        import ctypes

        ctypes.c_ssize_t.from_address(id(None)).value += NONE_PIN  # ob_refcnt, PyObject's first field


def _alive(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _watch_kernel(kernel_pid: int, controller_pid: int | None, cleanup_paths: tuple = ()) -> None:
    """Exit when the kernel that owns the cluster is gone.

    A kernel killed with SIGKILL runs no atexit handler, so without this its
    controller and engines would live on. The first engine to notice also
    stops the controller and removes the cluster's files (``cleanup_paths``).
    """
    global _watcher
    if _watcher is not None:
        return

    def run() -> None:
        import psutil

        while _alive(psutil, kernel_pid):
            time.sleep(1.0)
        if controller_pid:
            with contextlib.suppress(OSError):
                os.kill(controller_pid, 15)
        import shutil

        for path in cleanup_paths:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        os._exit(0)

    _watcher = threading.Thread(target=run, name="nbtool-kernel-watch", daemon=True)
    _watcher.start()


def hardware_facts() -> dict:
    """What this rank's machine has, for the planner: devices, their memory, host RAM, on GPU
    machines with nvidia-ml-py their NVLink / PCIe topology (nbtool.nvml), on CPU ranks how fast
    bf16 computes against fp32 (nbtool.rank.matmul_probe)."""
    import psutil
    import torch

    facts = {"host_memory": psutil.virtual_memory().total, "cpus": os.cpu_count(), "gpus": []}
    if not torch.cuda.is_available():  # CPU ranks: their bf16 compute against fp32's
        from .matmul_probe import matmul_flops

        facts["matmul_flops"] = list(matmul_flops())
    else:
        facts["gpus"] = [{"name": p.name, "memory": p.total_memory, "major": p.major} for p in
                         map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
        facts["cublas_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")  # sizes cuBLAS's workspaces
        if torch.cuda.device_count() > 1:
            facts["peer_access"] = torch.cuda.can_device_access_peer(0, 1)
        from ..nvml import detect

        facts["nvml"] = detect()  # links and PCIe from the driver, with nvidia-ml-py; else None
    return facts
