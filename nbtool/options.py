"""Typed options for the magics, and the checks that turn bad values into UsageErrors.

Every message names the bad value and what is allowed, so a user can fix the
line without reading a traceback.
"""
from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass

from IPython.core.error import UsageError

BACKENDS = ("auto", "gloo", "nccl")
# ipyparallel's engine launchers nbtool starts (Cluster(engines=...)); "local": this machine
LAUNCHERS = ("local", "ssh", "slurm", "mpi")


def _argtype(name: str, convert, check, allowed: str):
    """An argparse ``type=`` that reports the value and what is allowed."""

    def parse(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not valid; expected {allowed}")
        return value

    parse.__name__ = name
    return parse


positive_int = _argtype("value", int, lambda v: v >= 1, "an integer >= 1")
positive_number = _argtype("value", float, lambda v: v > 0, "a number > 0")
positive_seconds = _argtype("seconds", float, lambda v: v > 0, "a number of seconds > 0")
rank_number = _argtype("rank", int, lambda v: v >= 0, "a rank number >= 0")


def parse_int_list(text: str, what: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]; raises UsageError naming the bad part."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise UsageError(f"{what} {text!r}: {part.strip()!r} is not a number or range; "
                             f"use numbers and ranges like 0 or 0,2-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"{what} {text!r}: range {lo}-{hi} is backwards; write {hi}-{lo}")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise UsageError(f"{what} {text!r} names a number twice")
    return sorted(out)


def parse_ranks(text: str | None, world_size: int) -> list[int]:
    """Ranks selected by ``--ranks`` (all when None), checked against the cluster."""
    if text is None:
        return list(range(world_size))
    ranks = parse_int_list(text, "--ranks")
    bad = [r for r in ranks if r >= world_size]
    if bad:
        raise UsageError(f"--ranks {text!r}: rank {bad[0]} does not exist; this cluster has ranks "
                         f"{format_ranks(range(world_size))}")
    return ranks


def format_ranks(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    # a run of consecutive numbers keeps the same difference to its position in the sorted list
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(sorted(ranks)), lambda p: p[1] - p[0])]
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def label_ranks(ranks) -> str:
    """[1] -> 'rank 1'; [0, 1, 3] -> 'ranks 0-1,3'."""
    ranks = list(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_ranks(ranks)}"


@dataclass(frozen=True)
class ClusterOptions:
    """What ``%cluster start`` was asked for (kept for ``%cluster restart``)."""

    n: int = 2
    backend: str = "auto"
    gpus: tuple[int, ...] | None = None
    timeout: float = 120.0
    # the hang watchdog reports a collective still running after this many seconds
    collective_timeout: float = 60.0
    engines: str = "local"  # LAUNCHERS
    hosts: tuple[tuple[str, int], ...] | None = None  # --hosts node1:2,node2:2 (ssh)
    profile: str | None = None  # an ipyparallel profile whose launcher and controller settings are used
    interface: str | None = None  # the network interface for the controller, rendezvous and collectives
    ip: str | None = None  # the controller's address, when the user sets it (e.g. 0.0.0.0 on purpose)
    rendezvous: str | None = None  # "file:DIR" or "tcp" (None: owner-only file on one host, else tcp)
    slurm_args: str = ""  # extra sbatch options, e.g. "--partition=gpu --gpus-per-node=4"
    ssh_args: str = ""  # extra ssh/scp options, e.g. "-F ./ssh_config"

    @property
    def multi_host(self) -> bool:
        """Engines may run on other machines (the launcher is not this machine's processes)."""
        return self.engines != "local" or self.profile is not None


def parse_hosts(text: str, n: int | None) -> tuple[tuple[str, int], ...]:
    """``--hosts node1:2,node2:2`` (host:engines; ``user@host`` allowed; ``host`` alone is 1 engine)."""
    out = []
    for item in text.split(","):
        host, _, count = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "1")
        if not host or not count.isdigit() or int(count) < 1 or " " in host:
            raise UsageError(f"--hosts {text!r}: {item.strip()!r} is not HOST:N (N engines on HOST, N >= 1); "
                             "e.g. --hosts node1:2,node2:2")
        out.append((host, int(count)))
    total = sum(c for _, c in out)
    if n is not None and total != n:
        raise UsageError(f"--hosts {text!r} starts {total} engine(s) but -n is {n}; make them agree "
                         f"(or leave -n out: it is then {total})")
    return tuple(out)


def _ipv4_addresses() -> dict[str, list[str]]:
    """Each network interface of this machine with its IPv4 addresses (none for some)."""
    import socket

    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this machine, or a UsageError listing them."""
    addrs = _ipv4_addresses()
    if not addrs.get(name):
        have = ", ".join(f"{k} ({v[0]})" for k, v in sorted(addrs.items()) if v)
        what = "has no IPv4 address" if name in addrs else "does not exist"
        raise UsageError(f"--interface {name!r} {what} on this machine; interfaces with an address: {have}")
    return addrs[name][0]


def interface_of(address: str) -> str | None:
    """The local interface holding ``address``, or None."""
    return next((name for name, ipv4 in _ipv4_addresses().items() if address in ipv4), None)


def parse_rendezvous(text: str) -> str:
    """``file:DIR`` (a directory every host sees, writable here) or ``tcp``; the checked value."""
    import os

    if text == "tcp":
        return text
    kind, _, path = text.partition(":")
    if kind != "file" or not path:
        raise UsageError(f"--rendezvous {text!r}; allowed: file:DIR (a directory every host sees) or tcp "
                         "(a TCP store on rank 0)")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise UsageError(f"--rendezvous {text!r}: {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--rendezvous {text!r}: {path} is not writable by this user")
    return f"file:{path}"


def check_launch(opts: ClusterOptions) -> None:
    """The launcher options that need no engine: which launcher, its hosts, the interface."""
    if opts.engines not in LAUNCHERS:
        raise UsageError(f"--engines {opts.engines!r} is not a launcher nbtool starts; choose one of "
                         f"{', '.join(LAUNCHERS)} (or --profile NAME for an ipyparallel profile's own)")
    if opts.hosts is not None and opts.engines != "ssh":
        raise UsageError(f"--hosts applies to --engines ssh (this line has --engines {opts.engines})")
    if opts.engines == "ssh" and not opts.hosts:
        raise UsageError("--engines ssh needs --hosts HOST:N[,HOST:N], e.g. --hosts node1:2,node2:2")
    if opts.slurm_args and opts.engines != "slurm":
        raise UsageError(f"--slurm-args applies to --engines slurm (this line has --engines {opts.engines})")
    if opts.gpus is not None and opts.multi_host:
        raise UsageError("--gpus picks GPUs of this machine; with other launchers each host's rank i uses its "
                         "GPU i (LOCAL_RANK): drop --gpus, and use --backend nccl")
    if opts.interface is not None:
        interface_address(opts.interface)


@dataclass(frozen=True)
class Layout:
    """The resolved choice: which backend, and which logical GPUs (None: CPU ranks)."""

    n: int
    backend: str
    gpus: tuple[int, ...] | None

    @property
    def device_kind(self) -> str:
        return "cuda" if self.gpus or self.backend == "nccl" else "cpu"


def resolve_layout(opts: ClusterOptions, gpu_count: int) -> Layout:
    """Pick backend and GPUs for ``opts`` on a machine with ``gpu_count`` GPUs.

    One GPU per rank when GPUs are used; refuses layouts that cannot work
    before any process starts.
    """
    n = opts.n
    if n < 1:
        raise UsageError(f"-n {n}: a cluster needs at least 1 rank")
    if opts.backend not in BACKENDS:
        raise UsageError(f"--backend {opts.backend!r} is not known; choose one of {', '.join(BACKENDS)}")
    check_launch(opts)
    if opts.multi_host:  # the GPUs are the hosts': each host's rank i uses its GPU i
        return Layout(n, "nccl" if opts.backend == "nccl" else "gloo", None)
    if opts.gpus is not None:
        gpus = tuple(opts.gpus)
        missing = [g for g in gpus if g >= gpu_count]
        if missing:
            have = f"GPUs 0-{gpu_count - 1}" if gpu_count else "no GPU"
            raise UsageError(f"--gpus {format_ranks(gpus)}: GPU {missing[0]} does not exist; this machine has {have}")
        if n > len(gpus):
            raise UsageError(f"-n {n} needs one GPU per rank but --gpus gives {len(gpus)} "
                             f"({format_ranks(gpus)}); use -n {len(gpus)} or list more GPUs")
        backend = "nccl" if opts.backend == "auto" else opts.backend
        return Layout(n, backend, gpus[:n])
    if opts.backend == "nccl" or (opts.backend == "auto" and gpu_count):
        if gpu_count == 0:
            raise UsageError("--backend nccl needs GPUs and none are visible; use --backend gloo for CPU ranks")
        if gpu_count < n:
            raise UsageError(f"-n {n} with nccl needs one GPU per rank but {gpu_count} GPU(s) are visible; "
                             f"use -n {gpu_count}, or --backend gloo for CPU ranks")
        return Layout(n, "nccl", tuple(range(n)))
    return Layout(n, "gloo", None)


def _load_json(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise UsageError(f"--ds-config {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--ds-config {path!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--ds-config {path!r}: expected a JSON object")
    return cfg


# option values that argparse keeps as text and the spec holds in another form
CONVERT = {"class_list": lambda text: tuple(w.strip() for w in text.split(",") if w.strip()), "json_file": _load_json}


def strategy_spec(args, backend: str | None, device_kind: str, world_size: int | None = None):
    """A checked StrategySpec from parsed %%distributed arguments (UsageError if not valid).

    One loop over the option table (nbtool.spec): an option the line left out
    keeps the field's default.
    """
    from .spec import SpecError, validate

    spec = unchecked_spec(args)
    try:
        validate(spec, backend, device_kind, world_size)
    except SpecError as e:
        raise UsageError(str(e)) from None
    if args.export_config and not spec.is_zero:
        raise UsageError(f"--export-config writes a DeepSpeed config; it applies to zero1, zero2, zero3, not {spec.name}")
    return spec


def unchecked_spec(args):
    """The StrategySpec parsed %%distributed arguments ask for, not checked against a cluster (to name a
    recorded run by its line)."""
    from .spec import OPTION_FIELDS, StrategySpec

    values = {f.name: CONVERT.get(f.metadata["argparse"].get("type"), lambda v: v)(getattr(args, f.name))
              for f in OPTION_FIELDS if getattr(args, f.name) is not None}
    return StrategySpec(name=args.strategy, **values)


# the run options' values when absent (they are not spec fields)
RUN_DEFAULTS = {"export_config": None, "name": None, "metrics": True, "watch": True}
RUN_FLAGS = {"export_config": "--export-config", "name": "--name", "metrics": "--no-metrics", "watch": "--no-watch"}


def strategy_options_given(args) -> list[str]:
    """The strategy options on a line that has no strategy word (to refuse them)."""
    from .spec import ABSENT, OPTION_FIELDS, flag_of

    given = [flag_of(f) for f in OPTION_FIELDS if getattr(args, f.name) != ABSENT[f.metadata["kind"]]]
    return given + [RUN_FLAGS[k] for k, v in RUN_DEFAULTS.items() if getattr(args, k) != v]
