"""The pipeline bubble nbtool measures, against theory, as micro-batches grow.

On 2 CPU ranks (gloo), ``%%distributed pp --pp 2 --microbatches M --schedule S``
trains a 4-block TinyTransformer large enough that a micro-batch's compute
outweighs a gloo send, under each schedule (gpipe, 1f1b, and with 2 stages
per rank interleaved-1f1b, interleaved-zb, zbv). For each M and schedule it
prints the worst stage's idle share (step time minus the stage's own
forward/backward chunks, from the PipelineStep records) next to the
schedule's theory (spec.bubble_fraction: equal stages, free communication),
and the step time against 1f1b's. Measured exceeds theory by the sends and
receives (interleaving multiplies them by V) and the stages' imbalance (the
last stage also runs the head and the loss). Arms are interleaved and
repeated; medians are printed. Prints ``bubble_vs_theory=<1f1b, largest M>``
and ``step_<schedule>_vs_1f1b=<ratio>`` last.

    .venv/bin/python benchmarks/pipeline_bubble.py [--steps 6] [--micro 4 8] [--repeat 2]
"""
from __future__ import annotations

import argparse

from _shell import cluster_shell

CELL = """%%distributed pp --pp 2 --microbatches {m} --schedule {schedule} --quiet
from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
torch.manual_seed(0)
model = TinyTransformer(vocab=256, dim=256, heads=4, layers=4, seq=32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = strategy.prepare(model, optimizer, loss_fn=lm_loss)
data = SyntheticTokens(samples=4096, seq=32, vocab=256)
for i, (x, y) in enumerate(strategy.dataloader(data, batch_size={batch}, shuffle=False)):
    strategy.forward_backward(x, y)
    optimizer.step(); optimizer.zero_grad()
    if i + 1 == {steps}:
        break
"""


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")


def main() -> None:
    import statistics

    import nbtool
    from nbtool.run_analysis import bubble_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-micro", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved repetitions (medians reported)")
    a = ap.parse_args()
    ip = cluster_shell()
    seen: dict = {}  # (M, schedule) -> [(worst stage's idle share, mean step s, theory)]
    for _ in range(a.repeat):  # arms interleaved: a slow moment of the machine hits every schedule alike
        for m in a.micro:
            for schedule in SCHEDULES:
                ip.run_cell(CELL.format(m=m, schedule=schedule, batch=m * a.per_micro, steps=a.steps)).raise_error()
                rows = bubble_table(nbtool.last_run())
                seen.setdefault((m, schedule), []).append(
                    (max(r["bubble"] for r in rows), statistics.mean(r["step_s"] for r in rows), rows[0]["theory"]))
    ip.run_line_magic("cluster", "stop")
    for m in a.micro:
        base = statistics.median(x[1] for x in seen[m, "1f1b"])
        for schedule in SCHEDULES:
            runs = seen[m, schedule]
            idle, step = statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs)
            print(f"M={m:2d} {schedule:16s} theory {runs[0][2]:5.1%}  measured idle (worst stage) {idle:5.1%}  "
                  f"step {step * 1e3:6.1f} ms  step/1f1b {step / base:4.2f}", flush=True)
    m = max(a.micro)
    worst_1f1b = statistics.median(x[0] for x in seen[m, "1f1b"])
    print(f"bubble_vs_theory={worst_1f1b / seen[m, '1f1b'][0][2]:.2f}")
    for schedule in SCHEDULES[2:]:
        ratio = statistics.median(x[1] for x in seen[m, schedule]) / statistics.median(x[1] for x in seen[m, "1f1b"])
        print(f"step_{schedule.replace('-', '_')}_vs_1f1b={ratio:.2f}")


if __name__ == "__main__":
    main()
