"""Cost of nbtool's recorder on the ranks: the same training cell with metrics on vs off.

For ddp and zero3 on 2 CPU ranks, alternating rounds of ``%%distributed NAME``
(recording collectives, memory samples, steps and scalars, publishing them
live) and ``%%distributed NAME --no-metrics``; compares the median per-step
wall time of rank 0. Prints ``metrics_overhead_ratio=<worst>`` last; target
<= 1.03. (The dashboard itself draws in the kernel, not on the ranks.)
"""
from __future__ import annotations

import argparse
import statistics

from _shell import cluster_shell, median_step

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    ip = cluster_shell()
    ratios = {}
    for name in ("ddp", "zero3"):
        on, off = [], []
        for _ in range(a.rounds):
            off.append(median_step(ip, f"{name} --no-metrics", a.steps, a.warmup))
            on.append(median_step(ip, name, a.steps, a.warmup))
        ratios[name] = statistics.median(on) / statistics.median(off)
        print(f"{name:6} per-step median: metrics on {statistics.median(on) * 1e3:7.2f} ms   "
              f"off {statistics.median(off) * 1e3:7.2f} ms   ratio {ratios[name]:.3f}")
    ip.run_line_magic("cluster", "stop")
    print(f"metrics_overhead_ratio={max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
