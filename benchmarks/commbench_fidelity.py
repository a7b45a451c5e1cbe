"""Does %commbench report what the interconnect delivers, and does it say the same twice?

On one 2-rank cluster, for sizes 1 MiB .. 64 MiB: busbw from
``%commbench all_reduce --repeat R`` against a raw, hand-written timed loop of
``dist.all_reduce`` on the same ranks, measured the same way (warm-up, R
batches of ``iters`` calls after a barrier each, the slowest rank per batch,
the median over batches). The two arms alternate ``--rounds`` times, in
alternating order, on the same warm processes.

Prints per size the medians over rounds and the spread of the per-round
ratios, then:
- ``commbench_fidelity``: the smallest per-size ratio of the medians
  (nbtool / raw); target >= 0.95 (the tool must not distort what it measures);
- ``commbench_repeatability``: at sizes >= 4 MiB, the largest run-to-run
  spread (max - min) / median of nbtool's per-call median busbw; target <= 10%;
  next to it the same spread of the raw loop on the same ranks
  (``raw_repeatability``): what this machine allows any tool.
"""
from __future__ import annotations

import argparse
import statistics

from _shell import cluster_shell, nbtool_cluster

SIZES = [2**20 * k for k in (1, 2, 4, 8, 16, 32, 64)]


def raw_loop(size_bytes: int, iters: int, warmup: int, repeat: int) -> list[float]:
    """Runs on each rank: seconds per dist.all_reduce of size_bytes (float32), one per batch."""
    import time

    import torch
    import torch.distributed as dist

    buf = torch.ones(size_bytes // 4)
    for _ in range(warmup):
        dist.all_reduce(buf)
    out = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        out.append((time.perf_counter() - t0) / iters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ip = cluster_shell()
    view = nbtool_cluster(ip).view([0, 1])
    nb = {s: [] for s in SIZES}
    raw = {s: [] for s in SIZES}

    def nbtool_arm():
        res = ip.run_line_magic("commbench", f"all_reduce --sizes 1MB:64MB --iters {a.iters} --warmup {a.warmup} "
                                             f"--repeat {a.repeat}")
        assert res.wrong == 0
        for r in res.rows:
            nb[r["size_bytes"]].append(r["busbw"])

    def raw_arm():
        for s in SIZES:
            per_rank = view.apply_sync(raw_loop, s, a.iters, a.warmup, a.repeat)
            t = statistics.median(max(vals) for vals in zip(*per_rank))  # slowest rank per batch
            raw[s].append(s / t * 2 * (2 - 1) / 2)

    for i in range(a.rounds):
        for arm in ((nbtool_arm, raw_arm) if i % 2 == 0 else (raw_arm, nbtool_arm)):
            arm()
    ratios, spreads, raw_spreads = [], [], []
    print(f"{'size':>10} {'nbtool busbw GB/s':>18} {'raw busbw GB/s':>15} {'ratio':>6} {'per-round ratios':>18} "
          f"{'nbtool run-to-run':>18} {'raw run-to-run':>15}")
    for s in SIZES:
        n_bw, r_bw = statistics.median(nb[s]), statistics.median(raw[s])
        pair = [x / y for x, y in zip(nb[s], raw[s])]
        spread = (max(nb[s]) - min(nb[s])) / n_bw
        raw_spread = (max(raw[s]) - min(raw[s])) / r_bw
        ratios.append(n_bw / r_bw)
        if s >= 4 * 2**20:
            spreads.append(spread)
            raw_spreads.append(raw_spread)
        print(f"{s // 2**20:>7} MiB {n_bw / 1e9:>18.3f} {r_bw / 1e9:>15.3f} {n_bw / r_bw:>6.3f} "
              f"{min(pair):>8.3f}..{max(pair):<8.3f} {spread:>17.1%} {raw_spread:>15.1%}")
    ip.run_line_magic("cluster", "stop")
    fidelity, repeatability = min(ratios), max(spreads)
    print(f"target commbench_fidelity >= 0.95: {'met' if fidelity >= 0.95 else 'NOT met'}; "
          f"commbench_repeatability <= 10%: {'met' if repeatability <= 0.10 else 'NOT met'} "
          f"({a.rounds} rounds, {a.repeat} x {a.iters} calls per size and round)")
    # the noise of a shared 2-core machine moves single sizes both ways; a tool that distorts would
    # move them one way: the median over sizes says which
    print(f"median over sizes of the ratio: {statistics.median(ratios):.3f} (a distortion moves every size "
          f"one way; noise moves them both ways)")
    print(f"commbench_repeatability={repeatability:.3f} (raw_repeatability={max(raw_spreads):.3f}: the same "
          "spread of the hand-written loop on the same ranks)")
    print(f"commbench_fidelity={fidelity:.3f}")


if __name__ == "__main__":
    main()
