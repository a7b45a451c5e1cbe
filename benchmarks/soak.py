"""Soak: many consecutive cells and restarts; process and file-descriptor counts must stay flat.

    python benchmarks/soak.py [--cells 200] [--restarts 10]

Runs plain, collective and strategy cells (with metrics) in rotation on a
2-rank cluster and restarts it ``--restarts`` times spread over the run.
After a warm-up it compares the kernel's open file descriptors and the
number of processes under the kernel (controller, engines, nannies) with
their values at the end. Prints ``soak_fd_growth=<n>`` and
``soak_process_growth=<n>`` last (targets: 0 processes; fds within a few,
which ipyparallel's sockets may cycle). tests/test_soak.py runs a shorter
version of the same function in CI.
"""
from __future__ import annotations

import argparse
import os

import psutil

CELLS = [
    "%%distributed --quiet\nx = rank + 1",
    "%%distributed --quiet\nt = torch.ones(64) * rank; dist.all_reduce(t)",
    "%%rank 0 --quiet\ny = rank * 2",
    "%%distributed ddp --quiet --no-watch\nm, o = strategy.prepare(torch.nn.Linear(8, 8), None)\n"
    "m(torch.ones(2, 8)).sum().backward()",
]


def counts() -> tuple[int, int]:
    me = psutil.Process()
    return me.num_fds(), len(me.children(recursive=True))


def soak(ip, cells: int, restarts: int, warmup: int = 8) -> dict:
    """Run ``cells`` cells and ``restarts`` restarts in one shell; counts before and after."""
    restart_at = {int(cells * (i + 1) / (restarts + 1)) for i in range(restarts)}
    for i in range(warmup):
        ip.run_cell(CELLS[i % len(CELLS)]).raise_error()
    before = counts()
    for i in range(cells):
        if i in restart_at:
            ip.run_line_magic("cluster", "restart")
        ip.run_cell(CELLS[i % len(CELLS)]).raise_error()
    after = counts()
    return {"cells": cells, "restarts": len(restart_at), "fds": (before[0], after[0]),
            "processes": (before[1], after[1])}


def main() -> None:
    from _shell import cluster_shell

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=200)
    p.add_argument("--restarts", type=int, default=10)
    args = p.parse_args()
    ip = cluster_shell(2)
    r = soak(ip, args.cells, args.restarts)
    ip.run_line_magic("cluster", "stop")
    print(f"{r['cells']} cells, {r['restarts']} restarts; fds {r['fds'][0]} -> {r['fds'][1]}, "
          f"processes {r['processes'][0]} -> {r['processes'][1]} (pid {os.getpid()})")
    print(f"soak_fd_growth={r['fds'][1] - r['fds'][0]}")
    print(f"soak_process_growth={r['processes'][1] - r['processes'][0]}")


if __name__ == "__main__":
    main()
