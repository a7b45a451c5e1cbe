"""The pipeline bubble nbtool measures, against theory, as micro-batches grow.

On 2 CPU ranks (gloo), ``%%distributed pp --pp 2 --microbatches M --schedule S``
trains a TinyTransformer large enough that a micro-batch's compute outweighs
a gloo send. For each M and schedule it prints the idle share of each stage
(step time minus the stage's own forward/backward chunks, from the
PipelineStep records) next to (p-1)/(M+p-1), the share for equal stages
with free communication. Measured exceeds theory by the sends and receives
and by the stages' imbalance (the last stage also runs the head and the
loss); both should fall as M grows. Prints ``bubble_vs_theory=<ratio at the
largest M, 1f1b, worst stage>`` last.

    .venv/bin/python benchmarks/pipeline_bubble.py [--steps 6] [--micro 2 4 8]
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


def main() -> None:
    import nbtool
    from nbtool.run_analysis import bubble_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--per-micro", type=int, default=4, help="samples per micro-batch")
    a = ap.parse_args()
    ip = cluster_shell()
    last = None
    for m in a.micro:
        for schedule in ("gpipe", "1f1b"):
            ip.run_cell(CELL.format(m=m, schedule=schedule, batch=m * a.per_micro, steps=a.steps)).raise_error()
            rows = bubble_table(nbtool.last_run())
            worst = max(r["bubble"] for r in rows)
            print(f"M={m:2d} {schedule:5s} theory {rows[0]['theory']:5.1%}   "
                  + "   ".join(f"stage {r['stage']}: step {r['step_s'] * 1e3:6.1f} ms, compute "
                             f"{r['compute_s'] * 1e3:6.1f} ms, idle {r['bubble']:5.1%}" for r in rows), flush=True)
            if schedule == "1f1b":
                last = worst / rows[0]["theory"]
    ip.run_line_magic("cluster", "stop")
    print(f"bubble_vs_theory={last:.2f}")


if __name__ == "__main__":
    main()
