"""Refit nbtool.plan.cpu_costs on this machine from ``plan_accuracy.py`` runs.

    python benchmarks/plan_accuracy.py --dump runs.json --save runs/
    python benchmarks/fit_cpu_costs.py runs.json[,more_runs.json] [--check other_runs.json] [--all-runs]
    python benchmarks/fit_cpu_costs.py --links runs/[,more_runs/] [--check other_runs/]

The model (see nbtool/plan/cpu_costs.py): seconds per step outside
communication = S_PER_GFLOP (S_PER_GFLOP_16BIT for bf16 runs) x GFLOP per rank
+ S_PER_TENSOR[row] x parameter tensors per rank, one S_PER_TENSOR per
strategy row. Fitted by least squares
on the relative error (each run's error divided by its measured time), on the
median run of each strategy and shape (``--all-runs``: every run). A pipeline's
measured time holds its bubble: it is taken out as the planner adds it back
(compute x bubble). Prints the constants in cpu_costs' form and the in-sample
errors; ``--check`` prints the errors of the fitted model on another dump
(out of sample). Then SYNC_WAIT: per tp and pp, the median over its runs of
(exposed comm measured - the planner's link time) / the planner's compute;
and S_PER_SP_COLLECTIVE from the tp --sp runs (kept out of the fit above).

``--links``: the in-training collective table (cpu_costs.COLLECTIVES) from
the runs ``--save`` wrote. Per run, op and size: each step's mean time of the
collectives the rank-0 thread blocked on (the planner adds them up per step),
the median over steps 2..N; per op and size the median over runs; then a
weighted alpha-beta fit per op (nbtool.commbench.fit_alpha_beta). ZeRO-3's
fetches (all-gathers issued ahead and waited on) get their own row, fitted by
least squares on the relative error to each zero3 run's median step of
(fetches, bus bytes, seconds waited). ``--check``: each op's median relative
error on other runs' points (out of sample).
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
        if (not all_runs and not d.get("median", True)) or d.get("sp_collectives"):
            continue  # sequence parallelism's own host term is fitted apart (sp_host)
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


def sync_wait(paths: list[str]) -> dict:
    """{row: the median over its runs of (exposed comm measured - predicted without the wait) / predicted
    compute} for the rows cpu_costs.SYNC_WAIT holds (every run: one strategy's runs scatter too much for
    its median run alone)."""
    out: dict = {}
    for path in paths:
        for d in json.load(open(path)):
            if d["run"] in ("tp", "pp") and d["exposed_s"] is not None and d["pred_compute_s"]:
                link = d["pred_exposed_s"] - d.get("pred_wait_s", 0.0)
                out.setdefault(d["run"], []).append((d["exposed_s"] - link) / d["pred_compute_s"])
    return {row: statistics.median(v) for row, v in out.items()}


def sp_host(paths: list[str]) -> float | None:
    """cpu_costs.S_PER_SP_COLLECTIVE: the median over tp --sp runs of their measured time outside
    communication less the planner's without that term, over host_speed x their gathers and scatters."""
    from nbtool.plan.cpu_costs import S_PER_SP_COLLECTIVE

    out = []
    for path in paths:
        for d in json.load(open(path)):
            if n := d.get("sp_collectives"):
                speed = d.get("host_speed") or 1.0
                rest = d["pred_compute_s"] - S_PER_SP_COLLECTIVE * speed * n
                out.append((d["compute_s"] - rest) / (speed * n))
    return statistics.median(out) if out else None


def errors(points: list[dict], per_gflop: tuple, per_tensor: dict) -> list[tuple[str, float]]:
    return [(p["key"], (per_gflop[p["half"]] * p["gflop"] + per_tensor[p["row"]] * p["tensors"]) / p["measured"] - 1)
            for p in points if p["row"] in per_tensor]


def report(title: str, errs: list[tuple[str, float]]) -> None:
    worst = max(errs, key=lambda e: abs(e[1]))
    mags = [abs(e) for _, e in errs]
    print(f"{title}: worst {worst[1]:+.1%} ({worst[0]}), median |error| {statistics.median(mags):.1%}, "
          f"{sum(m <= 0.25 for m in mags)} of {len(mags)} within 25%")


def _link_points(dirs: str) -> tuple[dict, list]:
    """({op: {bus bytes: [a run's median step mean seconds, ...]}}, [(fetches, bus bytes, seconds) per zero3
    run]) from the runs saved in ``dirs`` (joined by commas)."""
    import glob
    import os
    from collections import defaultdict

    from nbtool.metrics import load

    blocking: dict = defaultdict(lambda: defaultdict(list))
    fetches = []
    for d in dirs.split(","):
        for path in sorted(glob.glob(os.path.join(d, "*_plain.json"))):
            run = load(path)
            last = max(m.step for m in run.steps if m.rank == 0)
            per_step: dict = defaultdict(lambda: defaultdict(list))  # (op, size) -> step -> seconds
            waited = {}  # async all-gather seq -> its step
            for c in run.comms:
                if c.rank != 0 or not 1 <= c.step <= last - 1 or c.bus_bytes <= 0:
                    continue
                if not c.asynchronous:
                    per_step[c.op, c.bus_bytes][c.step].append(c.seconds)
                elif c.op == "all_gather" and run.strategy == "zero3":
                    waited[c.seq] = c
            for (op, size), steps in per_step.items():
                blocking[op][size].append(statistics.median(statistics.fmean(v) for v in steps.values()))
            if waited:
                steps = defaultdict(lambda: [0, 0.0, 0.0])
                for c in waited.values():
                    steps[c.step][0] += 1
                    steps[c.step][1] += c.bus_bytes
                for w in run.waits:
                    if w.rank == 0 and w.seq in waited:
                        steps[waited[w.seq].step][2] += w.seconds
                fetches.append(tuple(statistics.median(s[i] for s in steps.values()) for i in range(3)))
    return blocking, fetches


def fit_links(blocking: dict, fetches: list) -> dict:
    """{op: (alpha, B)}; ZeRO-3's fetches under nbtool.plan.estimate.ZERO3_FETCH."""
    from nbtool.commbench import fit_alpha_beta
    from nbtool.plan.estimate import ZERO3_FETCH

    out = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        sizes = sorted(blocking.get(op, {}))
        if len(sizes) >= 2:
            f = fit_alpha_beta("broadcast", 2, sizes, [statistics.median(blocking[op][s]) for s in sizes])
            out[op] = (f.alpha_s, f.bus_bandwidth)
    if len(fetches) >= 2:
        a = np.array([[n / t, b / t] for n, b, t in fetches])
        (alpha, inv_bw), *_ = np.linalg.lstsq(a, np.ones(len(fetches)), rcond=None)
        out[ZERO3_FETCH] = (float(alpha), 1 / float(inv_bw) if inv_bw > 0 else float("inf"))
    return out


def check_links(links: dict, blocking: dict, fetches: list) -> None:
    from nbtool.plan.estimate import ZERO3_FETCH

    for op, (alpha, bw) in links.items():
        if op == ZERO3_FETCH:
            errs = [(n * alpha + b / bw) / t - 1 for n, b, t in fetches]
        else:
            errs = [(alpha + s / bw) / t - 1 for s, ts in blocking.get(op, {}).items() for t in ts]
        if errs:
            print(f"  {op}: median |error| {statistics.median(map(abs, errs)):.1%}, "
                  f"{sum(abs(e) <= 0.25 for e in errs)} of {len(errs)} within 25%, range {min(errs):+.0%}..{max(errs):+.0%}")


def main_links(dirs: str, check: str | None) -> None:
    links = fit_links(*_link_points(dirs))
    print("COLLECTIVES = {")
    for op, (alpha, bw) in links.items():
        print(f'    "{op}": ({alpha * 1e6:.0f}e-6, {bw / 1e9:.3f}e9),')
    print("}")
    print("in sample (each run's median step, per op and size):")
    check_links(links, *_link_points(dirs))
    if check:
        print("out of sample:")
        check_links(links, *_link_points(check))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump", nargs="?", help="one --dump file, or several joined by commas")
    ap.add_argument("--links", metavar="DIR", help="fit cpu_costs.COLLECTIVES from the runs plan_accuracy --save wrote")
    ap.add_argument("--check", help="another dump (with --links: runs directory): the fitted model's errors "
                    "there (out of sample)")
    ap.add_argument("--all-runs", action="store_true", help="fit every run, not each strategy's median run")
    a = ap.parse_args()
    if a.links:
        return main_links(a.links, a.check)
    if not a.dump:
        ap.error("give a --dump file, or --links DIR")
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
    waits = sync_wait(a.dump.split(","))
    print("SYNC_WAIT = {" + ", ".join(f'"{row}": {v:.2f}' for row, v in waits.items()) + "}")
    if (sp := sp_host(a.dump.split(","))) is not None:
        print(f"S_PER_SP_COLLECTIVE = {sp * 1e3:.2f}e-3")


if __name__ == "__main__":
    main()
