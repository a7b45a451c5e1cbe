"""Per-step cost of nbtool's strategy layer against hand-written torchrun loops.

The nbtool cells run with ``--no-metrics``: this measures the strategy layer
(prepare, the optimizer proxy, the ledger at each step); the recorder's own
cost is benchmarks/metrics_overhead.py's subject.

On the same 2 CPU ranks (gloo), the same model, data and loop run
- as ``%%distributed ddp`` / ``%%distributed zero3`` cells (strategy.prepare,
  strategy.backward, the StepOptimizer proxy and the ledger snapshot per step),
- as a plain script under torchrun (DDP / deepspeed.initialize with the same
  DeepSpeed config): one launch whose workers stay warm, as the engines do,
  and run the loop on request,
- and, with ``--in-engine``, to separate the strategy layer from the engine
  process it runs in, the torchrun script's loop called inside the same
  engines.
Each round runs the nbtool cell and the torchrun loop together, taking turns
step by step (benchmarks/_turns.py: each waits, untimed, while the other
steps), then (``--in-engine``) the in-engine loop and the torchrun loop the
same way; the job that starts alternates between rounds. So the two steps of a pair are a
fraction of a second apart, where whole runs had been seconds apart on a
machine whose speed drifts over seconds. Each of ``--rounds`` (>= 5; default
9) rounds gives one nbtool / torchrun pair: the ratio of rank 0's median
per-step wall times (benchmarks/_paired.py: median of the pairs, their
spread, the verdict). Prints ``strategy_overhead_ratio=<worse median of the
two>`` last; target <= 1.05.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _paired import ratio_line
from _shell import cluster_shell, median_step, nbtool_cluster
from _turns import Pipes

HERE = Path(__file__).resolve().parent


def torchrun_cmd(*args: str) -> list[str]:
    from nbtool.cluster import free_port

    # the agent polls its workers every 0.1 s by default; it lives through the nbtool arm too,
    # so it looks once a second
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--monitor-interval", "1",
            "--master_port", str(free_port()), str(HERE / "_raw_loop.py"), *args]


class WarmTorchrun:
    """One torchrun launch of ``_raw_loop.py --serve`` whose workers run the loop on request.

    Its rounds run on warm processes, as the nbtool arm's do on warm engines. ``submit`` returns
    at once (the job runs while the caller runs its partner); ``result`` waits for the times.
    """

    def __init__(self, timeout_s: float = 600.0):
        self.dir = Path(tempfile.mkdtemp(prefix="nbtool-raw-"))
        self.k, self.timeout_s = 0, timeout_s
        self.log = open(self.dir / "torchrun.log", "w")
        self.proc = subprocess.Popen(torchrun_cmd("--serve", str(self.dir)), stdout=self.log,
                                     stderr=subprocess.STDOUT, env=dict(os.environ, DS_ACCELERATOR="cpu"))

    def _ask(self, what) -> Path:
        tmp = self.dir / "req.tmp"
        tmp.write_text(json.dumps(what))
        tmp.rename(self.dir / f"{self.k}.req")  # the workers see it whole or not at all
        self.k += 1
        return self.dir / f"{self.k - 1}.json"

    def submit(self, *request) -> Path:
        return self._ask(list(request))

    def result(self, out: Path) -> list[float]:
        deadline = time.monotonic() + self.timeout_s
        while not out.exists():
            exited = self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                tail = (self.dir / "torchrun.log").read_text().strip().splitlines()[-5:]
                raise RuntimeError(f"warm torchrun {f'exited {self.proc.returncode}' if exited else 'timed out'} "
                                   f"on request {out.stem}; last log lines:\n" + "\n".join(tail))
            time.sleep(0.01)
        return json.loads(out.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self._ask("stop")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def paired_round(torchrun: WarmTorchrun, folder: Path, job: str, run_job, name: str, a, job_first: bool):
    """``run_job(turns)`` and the torchrun loop taking turns step by step; rank 0's two median step times."""
    with Pipes(folder, {job: 2, "torchrun": 2}) as pipes:
        pipes.give(job if job_first else "torchrun")
        out = torchrun.submit(name, a.steps, a.warmup, [str(folder), "torchrun", job, 2])
        mine = run_job([str(folder), job, "torchrun", 2])
        return mine, statistics.median(torchrun.result(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    # 60: with 30 a zero3 round's two medians still carried the steps' jitter (gloo's ~4 ms ticks):
    # pairs 0.92..1.07 and medians of 9 moving by 5% between runs
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--in-engine", action="store_true",
                    help="also pair the hand-written loop inside the engines with torchrun (the strategy layer alone)")
    a = ap.parse_args()
    ip = cluster_shell()
    view = nbtool_cluster(ip).view([0, 1])
    view.apply_sync(lambda p: __import__("sys").path.insert(0, p), str(HERE))
    torchrun = WarmTorchrun()
    try:
        ratios = compare(ip, view, torchrun, a)
    finally:
        torchrun.close()
    ip.run_line_magic("cluster", "stop")
    print(f"strategy_overhead_ratio={max(ratios.values()):.3f}")


def compare(ip, view, torchrun: WarmTorchrun, a) -> dict[str, float]:
    """Per strategy: the paired rounds, their figures printed; the median nbtool / torchrun ratio."""
    import _raw_loop

    folder = torchrun.dir / "turns"
    folder.mkdir()
    ratios = {}
    for name in ("ddp", "zero3"):
        nb, hand, eng, hand2 = [], [], [], []

        def nbtool_job(turns):
            return median_step(ip, f"{name} --no-metrics", a.steps, a.warmup, turns)

        def in_engine_job(turns):  # the torchrun loop's body inside the engines: no nbtool strategy layer
            return statistics.median(view.apply_sync(_raw_loop.train_steps, name, a.steps, a.warmup, turns)[0])

        jobs = [("nbtool", nbtool_job, nb, hand)] + [("engine", in_engine_job, eng, hand2)] * a.in_engine
        for i in range(a.rounds):
            for job, run_job, mine, theirs in jobs:
                t_job, t_raw = paired_round(torchrun, folder, job, run_job, name, a, job_first=i % 2 == 0)
                mine.append(t_job)
                theirs.append(t_raw)
        ms = lambda ts: [round(t * 1e3, 1) for t in ts]  # noqa: E731
        line = (f"{name:6} per-step median: nbtool {statistics.median(nb) * 1e3:7.2f} ms   torchrun "
                f"{statistics.median(hand) * 1e3:7.2f} ms   (rounds nbtool {ms(nb)}, torchrun {ms(hand)})")
        if eng:
            layer = statistics.median((x / y) / (u / v) for x, y, u, v in zip(nb, hand, eng, hand2))
            line += (f"   | the hand-written loop inside the engines, against torchrun in the same way: "
                     f"x{statistics.median(e / h for e, h in zip(eng, hand2)):.3f}; the strategy layer alone "
                     f"x{layer:.3f}   (rounds in-engine {ms(eng)}, torchrun {ms(hand2)})")
        print(line)
        ratios[name] = ratio_line(f"strategy_overhead {name} (nbtool / torchrun)", nb, hand, 1.05)
    return ratios


if __name__ == "__main__":
    main()
