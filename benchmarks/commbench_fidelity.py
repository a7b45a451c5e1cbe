"""Does %commbench report what the interconnect delivers, and does it say the same twice?

On one 2-rank cluster, for sizes 1 MiB .. 64 MiB: busbw from
``%commbench all_reduce`` against a raw, hand-written timed loop of
``dist.all_reduce`` on the same ranks, measured the same way (passes over
the sizes, one batch per size and pass after a barrier, the slowest rank per
batch, the median over a size's batches). A batch is at least ``--iters``
calls and lasts at least ``--min-batch-ms`` (%commbench's option: small
sizes, whose calls on this machine are either ~0.5 ms or a ~4 ms scheduler
tick, get more calls; the raw loop makes as many as %commbench chose). A
round interleaves ``--repeat`` passes of each arm (in orders where each arm
comes first, and follows each other arm, equally often), on the same warm
processes: nbtool's are one-pass %commbench sweeps, whose median is what
``--repeat R`` computes over its own passes. Besides the two, a third arm
runs the raw loop again (an A/A control whose ratio to the raw arm is what
noise alone gives), and a fourth copies the same bytes within each rank (no
communication; 4 times the calls), whose spread over rounds says whether the
drift is the machine's memory rather than the links.

Prints per size the medians over rounds and the spread of the per-round
ratios, then:
- ``commbench_fidelity``: the smallest per-size median of the per-round ratios
  (nbtool / raw); target >= 0.95 (the tool must not distort what it measures);
  ``aa_fidelity`` next to it: the same figure for the control;
- ``commbench_repeatability``: at sizes >= 4 MiB, the largest run-to-run
  spread (max - min) / median of nbtool's per-call median busbw; target <= 10%;
  next to it the same spread of the raw loop on the same ranks
  (``raw_repeatability``): what this machine allows any tool, and of the
  copy (``copy_repeatability``).
"""
from __future__ import annotations

import argparse
import statistics

from _shell import cluster_shell, nbtool_cluster

SIZES = [2**20 * k for k in (1, 2, 4, 8, 16, 32, 64)]


def timed_loop(op: str, sizes: list[int], iters: int | dict, warmup: int, repeat: int) -> dict[int, list[float]]:
    """Runs on each rank: {size: seconds per call, one per batch} of ``op`` on float32, in ``repeat``
    passes over the sizes as %commbench makes them (nbtool.rank.commbench): per pass one batch of
    ``iters`` calls per size (or ``iters[size]``), after ``warmup`` untimed calls in the first pass and
    one in later ones; every size a prefix of one buffer of the largest.

    ``op``: "all_reduce" (the hand-written loop), or "copy" between two tensors within the rank
    (no communication; both ranks copy at once, as both move memory during a collective).
    """
    import time

    import torch
    import torch.distributed as dist

    top = max(sizes) // 4
    big, big_dst = torch.ones(top), torch.empty(top)
    out: dict[int, list[float]] = {s: [] for s in sizes}
    for p in range(repeat):
        for s in sizes:
            buf, dst = big[: s // 4], big_dst[: s // 4]
            call = (lambda: dist.all_reduce(buf)) if op == "all_reduce" else (lambda: dst.copy_(buf))
            for _ in range(warmup if p == 0 else min(warmup, 1)):
                call()
            n = iters[s] if isinstance(iters, dict) else iters
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            out[s].append((time.perf_counter() - t0) / n)
    return out


def slowest_rank_medians(per_rank: list[dict[int, list[float]]]) -> dict[int, float]:
    """{size: the median over batches of the slowest rank's seconds per call}, as %commbench reports."""
    return {s: statistics.median(max(vals) for vals in zip(*(r[s] for r in per_rank))) for s in per_rank[0]}


def williams_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` arms in which each arm comes first equally often and follows each other arm
    equally often (a Williams design: n orders for even n, 2n for odd), so whatever one arm leaves
    behind for the next (warm caches, woken or idle processes) reaches every arm alike."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=40, help="calls per batch, at least")
    ap.add_argument("--min-batch-ms", type=float, default=150,
                    help="%%commbench's floor: sizes whose --iters calls take less get more (the raw loop the same)")
    ap.add_argument("--repeat", type=int, default=5, help="passes of each arm per round")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ip = cluster_shell()
    view = nbtool_cluster(ip).view([0, 1])
    nb, raw, ctl, mem = ({s: [] for s in SIZES} for _ in range(4))
    calls: dict[int, int] = {}  # per size, the calls %commbench chose last: the raw arms make as many

    def nbtool_pass(into):
        res = ip.run_line_magic("commbench", f"all_reduce --sizes {SIZES[0]}B:{SIZES[-1]}B --factor 2 "
                                             f"--iters {a.iters} --min-batch-ms {a.min_batch_ms} --warmup 1 "
                                             "--repeat 1")
        assert res.wrong == 0 and [r["size_bytes"] for r in res.rows] == SIZES
        for r in res.rows:  # one pass: its slowest rank's batch per size
            if into is not None:
                into[r["size_bytes"]].append(r["seconds"])
            calls[r["size_bytes"]] = r["iters"]

    def raw_pass(into, op="all_reduce", more=1):
        per_rank = view.apply_sync(timed_loop, op, SIZES, {s: more * c for s, c in calls.items()}, 1, 1)
        for s, t in slowest_rank_medians(per_rank).items():
            into[s].append(t)

    nbtool_pass(None)  # untimed: warms every size up and sets the calls
    # a copy of >= 8 MiB runs 5-7x faster than the all-reduce of the same bytes (30-60x below, in
    # cache): 4x the calls keep its batches no longer than the all-reduce's
    arms = (nbtool_pass, raw_pass, raw_pass, lambda into: raw_pass(into, "copy", 4))
    # a round: --repeat passes of each arm, interleaved, so the passes whose median each arm reports
    # lie seconds apart and the machine's drift reaches the arms alike. The orders are balanced for
    # carry-over (williams_orders): with a plain rotation each arm always followed the same one, so
    # whatever a pass leaves behind for the next reached one arm only.
    # nbtool's are %commbench sweeps of one pass each: the median over them is the statistic
    # %commbench --repeat R computes over its own passes. The third arm is the raw loop again (an A/A
    # control); the fourth copies the same bytes within each rank, no communication
    orders = williams_orders(len(arms))
    for i in range(a.rounds):
        times = [{s: [] for s in SIZES} for _ in arms]
        for p in range(a.repeat):
            for j in orders[(i * a.repeat + p) % len(orders)]:
                arms[j](times[j])
        for into, t in zip((nb, raw, ctl, mem), times):
            for s in SIZES:  # busbw for 2 ranks (= algbw); the copy's bytes per second
                into[s].append(s / statistics.median(t[s]))
    ratios, controls, spreads, raw_spreads, mem_spreads = [], [], [], [], []
    print(f"{'size':>10} {'nbtool GB/s':>12} {'raw GB/s':>9} {'nbtool/raw':>10} {'per-round':>13} "
          f"{'raw/raw (A/A)':>13} {'per-round':>13} {'nbtool run-to-run':>18} {'raw run-to-run':>15} "
          f"{'copy GB/s':>10} {'copy run-to-run':>16}")
    for s in SIZES:
        n_bw, r_bw = statistics.median(nb[s]), statistics.median(raw[s])
        pair = [x / y for x, y in zip(nb[s], raw[s])]
        aa = [x / y for x, y in zip(ctl[s], raw[s])]
        nb_spread, raw_spread, mem_spread = spread(nb[s]), spread(raw[s]), spread(mem[s])
        ratios.append(statistics.median(pair))
        controls.append(statistics.median(aa))
        if s >= 4 * 2**20:
            spreads.append(nb_spread)
            raw_spreads.append(raw_spread)
            mem_spreads.append(mem_spread)
        print(f"{s // 2**20:>6} MiB {n_bw / 1e9:>12.3f} {r_bw / 1e9:>9.3f} {ratios[-1]:>10.3f} "
              f"{min(pair):>6.3f}..{max(pair):<5.3f} {controls[-1]:>13.3f} {min(aa):>6.3f}..{max(aa):<5.3f} "
              f"{nb_spread:>18.1%} {raw_spread:>15.1%} {statistics.median(mem[s]) / 1e9:>10.2f} {mem_spread:>16.1%}")
    ip.run_line_magic("cluster", "stop")
    fidelity, repeatability = min(ratios), max(spreads)
    floor = min(min(controls), 1 / max(controls))
    print(f"target commbench_fidelity >= 0.95: {'met' if fidelity >= 0.95 else 'NOT met'}; "
          f"commbench_repeatability <= 10%: {'met' if repeatability <= 0.10 else 'NOT met'} "
          f"({a.rounds} rounds of {a.repeat} interleaved passes per arm, batches of >= {a.iters} calls and "
          f">= {a.min_batch_ms:g} ms)")
    # the noise of a shared 2-core machine moves single sizes both ways; a tool that distorts would
    # move them one way: the median over sizes says which, and the A/A control says how far noise
    # alone reaches when the same loop is compared with itself
    print(f"median over sizes of the ratio: {statistics.median(ratios):.3f} (a distortion moves every size "
          f"one way; noise moves them both ways)")
    print(f"aa_fidelity={floor:.3f} (the same figure for the raw loop against itself: how far the noise alone "
          f"reaches on this machine; nbtool's worst size is {fidelity - 1:+.1%} off the raw loop, the control's "
          f"{floor - 1:+.1%})")
    print(f"commbench_repeatability={repeatability:.3f} (raw_repeatability={max(raw_spreads):.3f}: the same "
          f"spread of the hand-written loop on the same ranks; copy_repeatability={max(mem_spreads):.3f}: of a "
          "copy of the same bytes within each rank, no communication)")
    print(f"commbench_fidelity={fidelity:.3f}")

if __name__ == "__main__":
    main()
