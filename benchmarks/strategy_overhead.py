"""Per-step cost of nbtool's strategy layer against hand-written torchrun loops.

The nbtool cells run with ``--no-metrics``: this measures the strategy layer
(prepare, the optimizer proxy, the ledger at each step); the recorder's own
cost is benchmarks/metrics_overhead.py's subject.

On the same 2 CPU ranks (gloo), the same model, data and loop run
- as ``%%distributed ddp`` / ``%%distributed zero3`` cells (strategy.prepare,
  strategy.backward, the StepOptimizer proxy and the ledger snapshot per step),
- as a plain script under torchrun (DDP / deepspeed.initialize with the same
  DeepSpeed config).
- and, to separate the strategy layer from the engine process it runs in,
  the torchrun script's loop called inside the same engines.
Each runs ``--rounds`` (>= 5; default 9) times, alternating in alternating order; each
round's median per-step wall time of rank 0 gives one nbtool / torchrun pair
(benchmarks/_paired.py: median of the pairs, their spread, the verdict).
Prints ``strategy_overhead_ratio=<worse median of the two>`` last; target
<= 1.05.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _paired import alternate, ratio_line
from _shell import cluster_shell, median_step, nbtool_cluster

HERE = Path(__file__).resolve().parent

def raw(name: str, steps: int, warmup: int, tries: int = 2) -> list[float]:
    """The hand-written loop under torchrun; retried once (a launch can lose its free port to a race)."""
    from nbtool.cluster import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for attempt in range(tries):
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_port", str(free_port()), str(HERE / "_raw_loop.py"), name, str(steps), str(warmup)],
            capture_output=True, text=True, env=env, timeout=600)
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
        print(f"torchrun {name} failed (exit {out.returncode}); last stderr lines:\n"
              + "\n".join(out.stderr.strip().splitlines()[-5:]), file=sys.stderr)
    raise RuntimeError(f"torchrun {name} failed {tries} times")


def in_engine(view, name: str, steps: int, warmup: int) -> float:
    """The torchrun loop's body run inside the cluster's engines (no nbtool strategy layer)."""
    import _raw_loop

    times = view.apply_sync(_raw_loop.train_steps, name, steps, warmup)
    return statistics.median(times[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    # 9: with 5 the ddp median moved by 5% between consecutive runs (per-pair ratios reach x1.2 both ways)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    ip = cluster_shell()
    view = nbtool_cluster(ip).view([0, 1])
    view.apply_sync(lambda p: __import__("sys").path.insert(0, p), str(HERE))
    ratios = {}
    for name in ("ddp", "zero3"):
        eng = []

        def nbtool_arm():
            return median_step(ip, f"{name} --no-metrics", a.steps, a.warmup)

        def hand_arm():
            eng.append(in_engine(view, name, a.steps, a.warmup))  # the in-engine loop rides with the baseline
            return statistics.median(raw(name, a.steps, a.warmup))

        nb, hand = alternate(a.rounds, nbtool_arm, hand_arm)
        nb_s, hand_s, eng_s = statistics.median(nb), statistics.median(hand), statistics.median(eng)
        print(f"{name:6} per-step median: nbtool {nb_s * 1e3:7.2f} ms   torchrun {hand_s * 1e3:7.2f} ms   "
              f"| the hand-written loop inside the engines {eng_s * 1e3:7.2f} ms: strategy layer alone "
              f"x{nb_s / eng_s:.3f}   (rounds nbtool {[round(t * 1e3, 1) for t in nb]}, "
              f"torchrun {[round(t * 1e3, 1) for t in hand]}, in-engine {[round(t * 1e3, 1) for t in eng]})")
        ratios[name] = ratio_line(f"strategy_overhead {name} (nbtool / torchrun)", nb, hand, 1.05)
    ip.run_line_magic("cluster", "stop")
    print(f"strategy_overhead_ratio={max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
