"""What ``--memory-timeline`` costs a long cell, and what ``--timeline-steps`` bounds.

On 2 CPU ranks, the same fsdp training cell (benchmarks/_shell.py's TRAIN_CELL,
``--warmup`` + ``--steps`` optimizer steps) runs three ways in alternating order,
``--rounds`` times:

- plain: the recorder only;
- bounded: ``--memory-timeline`` as it comes (the profiler follows the first
  ``TIMELINE_STEPS_DEFAULT`` steps, then is toggled off; the warm-up covers them,
  so every timed step runs after it);
- whole: ``--memory-timeline --timeline-steps N`` with N past the cell's end
  (every step recorded, as before the bound).

Per round, rank 0's median timed step of each, and each rank's peak RSS over
the cell above its RSS before it (the analysis after the cell dominates; the
larger rank's). Prints, through benchmarks/_paired.py (median of the per-round
ratios, their spread, the verdict):

- ``timeline_after_ratio``: bounded / plain step (target <= 1.05: the steps
  after the bound run without the profiler's bookkeeping);
- ``timeline_memory_ratio``: bounded / whole RSS growth (target <= 0.5 for the
  default 20 steps: the analysis needs memory for the steps it recorded);
- whole / plain step, shown: the profiler's bookkeeping while it records.
"""
from __future__ import annotations

import argparse
import statistics

from _paired import ratio_line
from _shell import cluster_shell, median_step

from nbtool.spec import TIMELINE_STEPS_DEFAULT

RSS = "from nbtool.rank.bootstrap import rss\n_rss = rss()"


def run(ip, line: str, steps: int, warmup: int) -> tuple[float, int]:
    """(rank 0's median timed step, the largest rank's peak RSS growth over the cell) for ``line``."""
    import nbtool

    cluster = nbtool.current_cluster()
    view = cluster.view(list(range(cluster.layout.n)))
    view.execute("open('/proc/self/clear_refs', 'w').write('5')\n" + RSS, block=True)  # the peak := now
    before = view.pull("_rss", block=True)
    step = median_step(ip, line, steps, warmup)
    view.execute(RSS, block=True)
    grown = max(peak - start for (start, _), (_, peak) in zip(before, view.pull("_rss", block=True)))
    return step, grown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14, help="timed steps per cell, after the warm-up")
    ap.add_argument("--warmup", type=int, default=TIMELINE_STEPS_DEFAULT + 1,
                    help="untimed first steps (at least the bounded timeline's, so every timed step is after it)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--strategy", default="fsdp")
    a = ap.parse_args()
    if a.warmup <= TIMELINE_STEPS_DEFAULT:
        ap.error(f"--warmup {a.warmup}: must be > {TIMELINE_STEPS_DEFAULT}, the steps the bounded timeline records")
    ip = cluster_shell()
    total = a.warmup + a.steps
    lines = {"plain": a.strategy, "bounded": f"{a.strategy} --memory-timeline",
             "whole": f"{a.strategy} --memory-timeline --timeline-steps {total + 1}"}
    out = {k: [] for k in lines}
    for i in range(a.rounds):
        order = list(lines) if i % 2 == 0 else list(reversed(lines))
        for k in order:
            out[k].append(run(ip, lines[k], a.steps, a.warmup))
    step = {k: [s for s, _ in v] for k, v in out.items()}
    grown = {k: [g for _, g in v] for k, v in out.items()}
    for k in lines:
        print(f"{k:8} {lines[k]:50} step {statistics.median(step[k]) * 1e3:7.2f} ms   "
              f"RSS growth over the cell {statistics.median(grown[k]) / 2**20:7.0f} MiB (median of {a.rounds})")
    after = ratio_line("timeline_after_ratio (bounded / plain step)", step["bounded"], step["plain"], 1.05)
    memory = ratio_line(f"timeline_memory_ratio (bounded / whole RSS growth, {total} steps)", grown["bounded"],
                        grown["whole"], 0.5)
    booked = [w / p for w, p in zip(step["whole"], step["plain"])]
    print(f"profiler bookkeeping (whole / plain step, shown): median {statistics.median(booked):.3f} of "
          f"{len(booked)} pairs, spread {min(booked):.3f}..{max(booked):.3f}")
    ip.run_line_magic("cluster", "stop")
    print(f"timeline_after_ratio={after:.3f}")
    print(f"timeline_memory_ratio={memory:.3f}")


if __name__ == "__main__":
    main()
