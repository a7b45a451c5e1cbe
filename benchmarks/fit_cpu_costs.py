"""Refit nbtool.plan.cpu_costs on this machine from a ``plan_accuracy.py --dump`` file.

    python benchmarks/plan_accuracy.py --dump runs.json
    python benchmarks/fit_cpu_costs.py runs.json[,more_runs.json] [--check other_runs.json] [--all-runs]

The model (see nbtool/plan/cpu_costs.py): seconds per step outside
communication = S_PER_GFLOP (S_PER_GFLOP_16BIT for bf16 runs) x GFLOP per rank
+ S_PER_TENSOR[row] x parameter tensors per rank, one S_PER_TENSOR per
strategy row. Fitted by least squares
on the relative error (each run's error divided by its measured time), on the
median run of each strategy and shape (``--all-runs``: every run). A pipeline's
measured time holds its bubble: it is taken out as the planner adds it back
(compute x bubble). Prints the constants in cpu_costs' form and the in-sample
errors; ``--check`` prints the errors of the fitted model on another dump
(out of sample).
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

ROWS = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp bf16", "tp", "pp")


def _row(run: str) -> str:
    return "fsdp bf16" if run == "fsdp --precision bf16" else run


def _points(path: str, all_runs: bool) -> list[dict]:
    out = []
    for d in json.load(open(path)):
        if not all_runs and not d.get("median", True):
            continue
        bubble = d["pred_bubble_s"] / d["pred_compute_s"] if d["pred_compute_s"] else 0.0
        out.append({"key": f"{d['shape']} {d['run']}", "row": _row(d["run"]), "half": "bf16" in d["run"],
                    "gflop": 6 * d["params"] * d["tokens"] / (d["tp"] * d["pp"]) / 1e9,
                    "tensors": d["tensors"] / d["pp"], "measured": d["compute_s"] / (1 + bubble)})
    return out


def fit(points: list[dict]) -> tuple[tuple[float, float], dict]:
    """((seconds per GFLOP in fp32, in 16 bits), seconds per tensor by row)."""
    rows = [r for r in ROWS if any(p["row"] == r for p in points)]
    a = np.array([[0.0 if p["half"] else p["gflop"] / p["measured"], p["gflop"] / p["measured"] if p["half"] else 0.0]
                  + [p["tensors"] / p["measured"] if p["row"] == r else 0.0 for r in rows] for p in points])
    x, *_ = np.linalg.lstsq(a, np.ones(len(points)), rcond=None)
    return (float(x[0]), float(x[1])), dict(zip(rows, map(float, x[2:])))


def errors(points: list[dict], per_gflop: tuple, per_tensor: dict) -> list[tuple[str, float]]:
    return [(p["key"], (per_gflop[p["half"]] * p["gflop"] + per_tensor[p["row"]] * p["tensors"]) / p["measured"] - 1)
            for p in points if p["row"] in per_tensor]


def report(title: str, errs: list[tuple[str, float]]) -> None:
    worst = max(errs, key=lambda e: abs(e[1]))
    mags = [abs(e) for _, e in errs]
    print(f"{title}: worst {worst[1]:+.1%} ({worst[0]}), median |error| {statistics.median(mags):.1%}, "
          f"{sum(m <= 0.25 for m in mags)} of {len(mags)} within 25%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump", help="one --dump file, or several joined by commas")
    ap.add_argument("--check", help="another dump: the fitted model's errors there (out of sample)")
    ap.add_argument("--all-runs", action="store_true", help="fit every run, not each strategy's median run")
    a = ap.parse_args()
    points = [p for path in a.dump.split(",") for p in _points(path, a.all_runs)]
    per_gflop, per_tensor = fit(points)
    print(f"S_PER_GFLOP = {per_gflop[0] * 1e3:.3g}e-3  # about {1 / per_gflop[0]:.0f} GFLOP/s per rank")
    print(f"S_PER_GFLOP_16BIT = {per_gflop[1] * 1e3:.3g}e-3  # about {1 / per_gflop[1]:.0f} GFLOP/s per rank")
    print("S_PER_TENSOR = {")
    for r, v in per_tensor.items():
        print(f'    "{r}": {v * 1e3:.3f}e-3,')
    print("}")
    report(f"in sample ({len(points)} runs)", errors(points, per_gflop, per_tensor))
    if a.check:
        report("out of sample", errors(_points(a.check, a.all_runs), per_gflop, per_tensor))


if __name__ == "__main__":
    main()
