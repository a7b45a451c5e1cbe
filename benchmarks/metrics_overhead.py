"""Cost of nbtool's recorder on the ranks: the same training with metrics on vs off.

Two measurements for ddp and zero3 on 2 CPU ranks:

- paired (the headline): one ``%%distributed NAME --quiet`` training run
  whose recorder is switched on and off in alternating blocks of steps
  (started/stopped between steps, outside the timed region; collectives
  wrapped, memory sampled every 0.25 s, steps, scalars; ``--block``), so
  machine drift hits both arms alike; ratio of the median step time of rank 0, on / off. DDP's
  Python comm hook, installed when a cell records, is in both arms here.
- separate cells: alternating rounds of ``%%distributed NAME`` and
  ``%%distributed NAME --no-metrics`` (this includes DDP's comm hook vs its
  C++ all-reduce); medians over rounds. Noisier: rounds on this 2-core machine
  vary by 10-20 %.

Both report through benchmarks/_paired.py: the paired run is cut into
``--pairs`` consecutive stretches (one on/off pair each), the separate cells
alternate in alternating order; each prints the median of the per-pair
ratios, their spread and the verdict. Prints
``metrics_overhead_ratio=<worse paired median>`` last; target <= 1.03.
Live publishing to the kernel happens only when a dashboard is shown, so it
is not in either arm (``--quiet``); the dashboard draws in the kernel.
"""
from __future__ import annotations

import argparse
import statistics

from _paired import alternate, ratio_line
from _shell import cluster_shell, median_step

PAIRED = """%%distributed {name} --quiet
import time
from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
model = TinyTransformer(vocab=256, dim=256, heads=4, layers=4, seq=32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = strategy.prepare(model, optimizer)
data = SyntheticTokens(samples=8192, seq=32, vocab=256)
rec = strategy.recorder
on_t, off_t = [], []
for i, (x, y) in enumerate(strategy.dataloader(data, batch_size=8, shuffle=False)):
    on = (i // {block}) % 2 == 0
    if on and strategy.recorder is None:
        strategy.recorder = rec
        rec.start()
    elif not on and strategy.recorder is not None:
        rec.stop()
        strategy.recorder = None
    t0 = time.perf_counter()
    loss = lm_loss(model(x), y)
    strategy.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    strategy.log(loss=loss)
    if i >= {warmup}:
        (on_t if on else off_t).append(time.perf_counter() - t0)
    if i + 1 == {warmup} + {steps}:
        break
strategy.recorder = rec
"""


def paired(ip, name: str, steps: int, warmup: int, block: int, pairs: int) -> tuple[list, list]:
    """The paired run cut into ``pairs`` consecutive stretches: per stretch, the median on and off step."""
    ip.run_cell(PAIRED.format(name=name, steps=steps, warmup=warmup, block=block)).raise_error()
    ip.run_line_magic("dist_pull", "on_t off_t --rank 0")
    on_t, off_t = ip.user_ns["on_t"], ip.user_ns["off_t"]
    n = min(len(on_t), len(off_t)) // pairs
    return ([statistics.median(on_t[i * n:(i + 1) * n]) for i in range(pairs)],
            [statistics.median(off_t[i * n:(i + 1) * n]) for i in range(pairs)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="steps per separate-cell round")
    ap.add_argument("--paired-steps", type=int, default=240, help="steps of the paired run (half on, half off)")
    ap.add_argument("--block", type=int, default=2, help="steps per on/off block of the paired run")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of separate cells (pairs)")
    ap.add_argument("--pairs", type=int, default=5, help="stretches the paired run is cut into (pairs)")
    a = ap.parse_args()
    ip = cluster_shell()
    ratios = {}
    for name in ("ddp", "zero3"):
        on_p, off_p = paired(ip, name, a.paired_steps, a.warmup, a.block, a.pairs)
        on, off = alternate(a.rounds, lambda: median_step(ip, name, a.steps, a.warmup),
                            lambda: median_step(ip, f"{name} --no-metrics", a.steps, a.warmup))
        print(f"{name:6} paired run: metrics on {statistics.median(on_p) * 1e3:7.2f} ms   "
              f"off {statistics.median(off_p) * 1e3:7.2f} ms   | separate cells: on "
              f"{statistics.median(on) * 1e3:7.2f} ms   off {statistics.median(off) * 1e3:7.2f} ms")
        ratios[name] = ratio_line(f"metrics_overhead {name} (paired run, on / off)", on_p, off_p, 1.03)
        ratio_line(f"metrics_overhead {name} (separate cells, on / off)", on, off, 1.03)
    ip.run_line_magic("cluster", "stop")
    print(f"metrics_overhead_ratio={max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
