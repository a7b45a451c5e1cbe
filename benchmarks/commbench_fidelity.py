"""Does %commbench report what the interconnect delivers? Against a hand-written loop.

On one 2-rank cluster, for sizes 1 MiB .. 64 MiB: busbw from
``%commbench all_reduce`` against a raw, hand-written timed loop of
``dist.all_reduce`` on the same ranks (same warm-up, iterations and slowest-
rank rule), alternating the two ``--rounds`` times and taking medians.
Prints ``commbench_fidelity=<min over sizes of nbtool/raw>`` last; target
>= 0.95 (the tool must not distort what it measures).
"""
from __future__ import annotations

import argparse
import statistics

from _shell import cluster_shell, nbtool_cluster

SIZES = [2**20 * k for k in (1, 2, 4, 8, 16, 32, 64)]


def raw_loop(size_bytes: int, iters: int, warmup: int) -> float:
    """Runs on each rank: mean seconds per dist.all_reduce of size_bytes (float32)."""
    import time

    import torch
    import torch.distributed as dist

    buf = torch.ones(size_bytes // 4)
    for _ in range(warmup):
        dist.all_reduce(buf)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ip = cluster_shell()
    view = nbtool_cluster(ip).view([0, 1])
    nb = {s: [] for s in SIZES}
    raw = {s: [] for s in SIZES}
    for _ in range(a.rounds):
        res = ip.run_line_magic("commbench", f"all_reduce --sizes 1MB:64MB --iters {a.iters} --warmup {a.warmup}")
        assert res.wrong == 0
        for r in res.rows:
            nb[r["size_bytes"]].append(r["busbw"])
        for s in SIZES:
            t = max(view.apply_sync(raw_loop, s, a.iters, a.warmup))  # slowest rank, as nccl-tests
            raw[s].append(s / t * 2 * (2 - 1) / 2)
    ratios = []
    print(f"{'size':>10} {'nbtool busbw GB/s':>18} {'raw busbw GB/s':>15} {'ratio':>6}")
    for s in SIZES:
        n_bw, r_bw = statistics.median(nb[s]), statistics.median(raw[s])
        ratios.append(n_bw / r_bw)
        print(f"{s // 2**20:>7} MiB {n_bw / 1e9:>18.3f} {r_bw / 1e9:>15.3f} {n_bw / r_bw:>6.3f}")
    ip.run_line_magic("cluster", "stop")
    print(f"commbench_fidelity={min(ratios):.3f}")


if __name__ == "__main__":
    main()
