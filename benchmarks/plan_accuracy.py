"""How close the planner gets to what 2 CPU ranks measure, after calibrating on a different run.

    python benchmarks/plan_accuracy.py [--steps 6] [--shapes tutorial,wide,deep] [--strategies ddp,tp] [--dump F]

For three model shapes (the tutorial model, one wide and shallow, one narrow
and deep) and each of ddp, fsdp, fsdp bf16, zero1, zero2, zero3, tp and pp:
the cell runs once plain (times) and once with ``--memory-timeline`` (peak
tensor bytes: torch.profiler's tracked tensors, or the allocator's total where
torch cannot categorise the run). Each run is predicted with the Hardware
calibrated on the shape's ddp run (ddp itself on its fsdp run): the link fit
from that run's collectives and its achieved compute rate
(nbtool.plan.versus). Prints per run the errors, then:

- ``plan_exact_states`` / ``plan_exact_bytes``: the worst model-state and
  bus-bytes-per-step errors where the planner claims exactness (targets 0%
  and <= 2%);
- ``plan_memory_error``: the worst |predicted - measured| / measured peak
  tensor memory (target <= 10%);
- ``plan_time_error``: the worst step-time error (target <= 25%);
- ``--dump F``: every run's measured and predicted terms as JSON (what
  nbtool.plan.cpu_costs was fitted on);
- ``memory_timeline_cost``: the median ratio of step time with
  ``--memory-timeline`` to without (the tracker's cost; it is opt-in).
"""
from __future__ import annotations

import argparse

from _shell import cluster_shell

SHAPES = {  # vocab, dim, heads, layers, seq
    "tutorial": (256, 128, 4, 4, 32),
    "wide": (256, 384, 6, 2, 32),
    "deep": (256, 48, 4, 12, 32),
}
STRATEGIES = ("ddp", "fsdp", "fsdp --precision bf16", "zero1", "zero2", "zero3", "tp", "pp")
CELL = """%%distributed {line} --quiet --no-watch
from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
model = TinyTransformer(vocab={vocab}, dim={dim}, heads={heads}, layers={layers}, seq={seq})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = strategy.prepare(model, optimizer, loss_fn=lm_loss)
data = SyntheticTokens(samples=512, seq={seq}, vocab={vocab})
for i, (x, y) in enumerate(strategy.dataloader(data, batch_size=8, shuffle=False)):
    loss = strategy.forward_backward(x, y)
    optimizer.step(); optimizer.zero_grad()
    if i == {steps} - 1:
        break
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dump", help="write each run's measured and predicted terms to this JSON file")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="a subset to look at one term (ddp and fsdp are added: they calibrate the others)")
    a = ap.parse_args()
    asked = a.strategies.split(",")
    if unknown := sorted(set(asked) - set(STRATEGIES)):
        ap.error(f"--strategies: {', '.join(unknown)} not among {', '.join(STRATEGIES)}")
    chosen = [line for line in STRATEGIES if line in asked or line in ("ddp", "fsdp")]
    import statistics

    import nbtool
    from nbtool import run_analysis
    from nbtool.plan.versus import calibrate, measured_compute_s, planner_inputs, versus

    ip = cluster_shell(2)
    worst = {"states": 0.0, "bytes": 0.0, "memory": 0.0, "time": 0.0}
    costs = []  # step time with --memory-timeline / without, per run
    where = {}
    dumped = []
    print(f"{'shape':<9} {'run':<22} {'states':>8} {'bytes':>8} {'peak mem':>9} {'step':>8}  calibrated on")
    for shape in a.shapes.split(","):
        vocab, dim, heads, layers, seq = SHAPES[shape]
        runs, timelines = {}, {}
        for line in chosen:
            for timeline in (False, True):
                ip.run_cell(CELL.format(line=line + (" --memory-timeline" if timeline else ""), vocab=vocab,
                                        dim=dim, heads=heads, layers=layers, seq=seq, steps=a.steps)).raise_error()
                (timelines if timeline else runs)[line] = nbtool.last_run()
        for line in chosen:
            base = "fsdp" if line == "ddp" else "ddp"
            run = runs[line]
            summ = run_analysis.summary(run)
            costs.append(run_analysis.summary(timelines[line])["step_s"] / summ["step_s"])
            run.timelines = timelines[line].timelines  # memory from the recorded run, times from the plain one
            v = versus(run, calibrate(runs[base]), f"run {base!r}")
            cells = []
            for key, figure in (("states", "model states"), ("bytes", "bus bytes / step"),
                                ("memory", "peak tensor memory"), ("time", "step time")):
                row = v.row(figure)
                cells.append("-" if row.error is None else f"{row.error:+.1%}")
                judged = row.tolerance is not None or key in ("memory", "time")
                if row.error is not None and judged and abs(row.error) > worst[key]:
                    worst[key], where[key] = abs(row.error), f"{shape} {line}"
            e = v.estimate
            _, mshape, training, tp, pp = planner_inputs(run)
            dumped.append({"shape": shape, "run": line, "params": mshape.params, "tensors": len(mshape.numels),
                           "tp": tp, "pp": pp,
                           "tokens": training.micro_batch * (training.seq or 0) * training.grad_accum,
                           "step_s": summ["step_s"], "comm_busy_s": summ["comm_s_per_step"],
                           "exposed_s": summ["exposed_s_per_step"], "compute_s": measured_compute_s(run),
                           "pred_compute_s": e.compute_s, "pred_comm_s": e.comm_s, "pred_exposed_s": e.exposed_comm_s,
                           "pred_bubble_s": e.bubble_s, "pred_step_s": e.step_s})
            print(f"{shape:<9} {line:<22} " + " ".join(f"{c:>8}" for c in cells[:2]) + f" {cells[2]:>9} "
                  f"{cells[3]:>8}  {base}")
    ip.run_line_magic("cluster", "stop")
    if a.dump:
        import json

        with open(a.dump, "w") as f:
            json.dump(dumped, f, indent=1)
    for key, name, target in (("states", "plan_exact_states", 0.0), ("bytes", "plan_exact_bytes", 0.02),
                              ("memory", "plan_memory_error", 0.10), ("time", "plan_time_error", 0.25)):
        verdict = "met" if worst[key] <= target + 1e-12 else "NOT met"
        print(f"{name}={worst[key]:.3f} (worst: {where.get(key, '-')}); target <= {target:g}: {verdict}")
    print(f"memory_timeline_cost=x{statistics.median(costs):.2f} step time (spread x{min(costs):.2f}..x{max(costs):.2f};"
          " opt-in, so not part of metrics_overhead)")


if __name__ == "__main__":
    main()
