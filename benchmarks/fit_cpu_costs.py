"""Refit nbtool.plan.cpu_costs on this machine from ``plan_accuracy.py`` runs.

    python benchmarks/plan_accuracy.py --dump runs.json --save runs/
    python benchmarks/fit_cpu_costs.py runs.json[,more_runs.json] [--check other_runs.json] [--all-runs]
                                       [--leave-one-out]
    python benchmarks/fit_cpu_costs.py --links runs/[,more_runs/] [--check other_runs/]

The model (see nbtool/plan/cpu_costs.py): seconds per step outside
communication = host speed x (S_PER_GFLOP x fp32 GFLOP per rank +
S_PER_TENSOR[row] x parameter tensors per rank), one S_PER_TENSOR per
strategy row, and for pp one per tensor and micro-batch and one per
micro-batch too (S_PER_TENSOR_MICROBATCH, S_PER_MICROBATCH: fitted where the
runs' micro-batch counts differ,
``plan_accuracy.py --strategies 'pp --microbatches 2,pp,pp --microbatches
8'``); a bf16 run's FLOPs take their time at the ranks' measured bf16
rate (the dump's ``bf16_flops``), outside the host speed. Each dump (one
session's set) has its own host speed, fitted with the constants (least
squares on the relative error): this machine's speed moved by up to 40%
between sessions, and the planner uses only the model's ratios between
strategies (a calibration run sets the speed). Fitted on the median run of
each strategy and shape (``--all-runs``: every run). A pipeline's measured
compute leaves its bubble out (its stages wait it out in a receive), as the
planner adds it on top. Prints the constants in cpu_costs' form, each set's
speed, and the errors of each median run predicted as plan_accuracy predicts it (its
shape's fsdp run calibrating the speed, ddp's for fsdp) in sample and with
cpu_costs' current constants; ``--leave-one-out``: each dump predicted by the
fit on the others; ``--check``: the errors on another dump (out of sample).
Then SYNC_WAIT: per tp and pp, the median over its runs of (step time less
its measured compute - the planner's link time and bubble) / the planner's
compute;
and S_PER_SP_COLLECTIVE from the tp --sp runs (kept out of the fit above).

``--links``: the in-training collective table (cpu_costs.COLLECTIVES) from
the runs ``--save`` wrote, one point per run and row: a typical step's
(collectives, bus bytes, seconds), each the median over steps 2..N-1 on
rank 0, fitted as count x alpha + bus bytes / B by least squares on
log(predicted / measured) (the planner adds an op's collectives up per step
and models a typical step). The rows: per op, the collectives the thread
blocked on, in data-parallel runs (tp's and pp's wait for the other rank is
SYNC_WAIT's); sequence parallelism's all-gathers and reduce-scatters, in the
tp --sp runs (rows of their own); ZeRO-3's fetches (all-gathers issued ahead), the seconds waited
on them; DDP's bucket all-reduces, their in-flight union (the reducer's wait
is not observable, so the planner's compute for DDP leaves them that union).
``--check``: each row's errors on other runs' points (out of sample).
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

ROWS = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp bf16", "tp", "pp")
# rows with terms per micro-batch too: per tensor (cpu_costs.S_PER_TENSOR_MICROBATCH) and per stage
# (cpu_costs.S_PER_MICROBATCH)
MICRO_ROWS = ("pp",)


def _row(run: str) -> str:
    return "fsdp bf16" if run == "fsdp --precision bf16" else run.split(" --microbatches")[0]


def _points(path: str, all_runs: bool) -> list[dict]:
    """Each run of one dump (``all_runs``: every run; else each strategy's median run), with the time
    its bf16 FLOPs take at the ranks' measured bf16 rate (``fixed``: the planner does not scale it)."""
    out = []
    for d in json.load(open(path)):
        if (not all_runs and not d.get("median", True)) or d.get("sp_collectives"):
            continue  # sequence parallelism's own host term is fitted apart (sp_host)
        if _row(d["run"]) not in ROWS:
            continue  # ZeRO in bf16 (the planner takes its stage's row), other pipeline schedules: not fitted
        half = "bf16" in d["run"]
        gflop = 6 * d["params"] * d["tokens"] / (d["tp"] * d["pp"]) / 1e9
        if half and not d.get("bf16_flops"):
            continue  # a bf16 run without the ranks' probe: its FLOP rate is not this model's to fit
        out.append({"set": path, "shape": d["shape"], "run": d["run"], "median": d.get("median", True),
                    "key": f"{d['shape']} {d['run']}", "row": _row(d["run"]), "half": half, "gflop": gflop,
                    "fixed": gflop * 1e9 / d["bf16_flops"] if half else 0.0,
                    "tensors": d["tensors"] / d["pp"], "measured": d["compute_s"],
                    "micro": d.get("micro_batches", 1) if _row(d["run"]) in MICRO_ROWS else 1})
    return out


def _features(p: dict, rows: list, micro_rows: list) -> list:
    """What host_speed scales: the fp32 FLOPs, the parameter tensors (in the run's row) and, in the rows
    with them, the tensors x micro-batches and the micro-batches."""
    return ([0.0 if p["half"] else p["gflop"]] + [p["tensors"] if p["row"] == r else 0.0 for r in rows]
            + [p["tensors"] * p["micro"] if p["row"] == r else 0.0 for r in micro_rows]
            + [p["micro"] if p["row"] == r else 0.0 for r in micro_rows])


def fit(points: list[dict], rounds: int = 50) -> tuple[dict, dict]:
    """({"gflop": seconds per fp32 GFLOP, row: seconds per tensor}, {set: its host speed}).

    Each set (one plan_accuracy run: one session) gets its own host speed: this machine's speed moved
    by up to 40% between sessions, and the planner only ever uses the model's ratios between
    strategies (a calibration run sets the speed). Least squares on the relative error, alternating
    the constants (linear, the speeds fixed) and the speeds (closed form, the constants fixed); the
    speeds' geometric mean is 1, so the constants are those of a typical session here."""
    rows = [r for r in ROWS if any(p["row"] == r for p in points)]
    # a row's micro-batch term where its runs had different micro-batch counts (else it is the row's own)
    micro_rows = [r for r in MICRO_ROWS if len({p["micro"] for p in points if p["row"] == r}) > 1]
    sets = sorted({p["set"] for p in points})
    x = np.array([_features(p, rows, micro_rows) for p in points])
    measured = np.array([p["measured"] for p in points])
    target = 1 - np.array([p["fixed"] for p in points]) / measured
    index = [np.array([p["set"] == s for p in points]) for s in sets]
    speed = np.ones(len(points))
    for _ in range(rounds):
        theta, *_ = np.linalg.lstsq(x * (speed / measured)[:, None], target, rcond=None)
        scaled = x @ theta / measured
        for i in index:
            speed[i] = scaled[i] @ target[i] / (scaled[i] @ scaled[i])
    mean = float(np.exp(np.mean([np.log(speed[i][0]) for i in index])))
    theta = theta * mean
    names = ["gflop"] + rows + [f"{r} micro" for r in micro_rows] + [f"{r} stage" for r in micro_rows]
    return dict(zip(names, map(float, theta))), {s: float(speed[i][0]) / mean for s, i in zip(sets, index)}


def calibrated_errors(points: list[dict], costs: dict) -> list[tuple[str, float]]:
    """Each median run's time outside communication predicted as plan_accuracy does: its shape's fsdp
    run (ddp's for fsdp itself) sets the host speed, the model the rest."""
    def model(p):
        return ((0.0 if p["half"] else costs["gflop"] * p["gflop"])
                + (costs[p["row"]] + costs.get(f"{p['row']} micro", 0.0) * p["micro"]) * p["tensors"]
                + costs.get(f"{p['row']} stage", 0.0) * p["micro"])

    runs: dict = {}
    for p in points:
        if p["median"] and p["row"] in costs:
            runs.setdefault((p["set"], p["shape"]), {})[p["run"]] = p
    out = []
    for by_run in runs.values():
        for run, p in by_run.items():
            b = by_run.get("ddp" if run == "fsdp" else "fsdp")
            if b is not None:
                speed = (b["measured"] - b["fixed"]) / model(b)
                out.append((p["key"], (speed * model(p) + p["fixed"]) / p["measured"] - 1))
    return out


def current_costs() -> dict:
    from nbtool.plan import cpu_costs

    return {"gflop": cpu_costs.S_PER_GFLOP, **cpu_costs.S_PER_TENSOR,
            **{f"{r} micro": v for r, v in cpu_costs.S_PER_TENSOR_MICROBATCH.items()},
            **{f"{r} stage": v for r, v in cpu_costs.S_PER_MICROBATCH.items()}}


def sync_wait(paths: list[str]) -> dict:
    """{row: the median over its runs of (the step's time outside compute measured - the planner's link
    time and bubble) / predicted compute} for the rows cpu_costs.SYNC_WAIT holds (every run: one strategy's runs
    scatter too much for its median run alone). Outside compute: tp's blocked time; a pipeline's
    schedule's idle time, as its compute is measured (nbtool.plan.versus.measured_compute_s; SYNC_WAIT's
    pp row was fitted when that was its comm busy time)."""
    out: dict = {}
    for path in paths:
        for d in json.load(open(path)):
            if _row(d["run"]) in ("tp", "pp") and d["compute_s"] is not None and d["pred_compute_s"]:
                link = d["pred_exposed_s"] - d.get("pred_wait_s", 0.0) + d["pred_bubble_s"]  # and theory's bubble
                wait = (d["step_s"] - d["compute_s"] - link) / d["pred_compute_s"]
                out.setdefault(_row(d["run"]), []).append(wait)
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


def report(title: str, errs: list[tuple[str, float]]) -> None:
    worst = max(errs, key=lambda e: abs(e[1]))
    mags = [abs(e) for _, e in errs]
    print(f"{title}: worst {worst[1]:+.1%} ({worst[0]}), median |error| {statistics.median(mags):.1%}, "
          f"{sum(m <= 0.25 for m in mags)} of {len(mags)} within 25%")


def _link_points(dirs: str) -> dict:
    """{row: [(collectives, bus bytes, seconds) a typical step of one run]} from the runs saved in ``dirs``
    (joined by commas), each figure the median over steps 2..N-1 on rank 0. The rows: per op, the
    collectives the thread blocked on (data-parallel runs: tensor parallelism's and a pipeline's wait
    for the other rank is SYNC_WAIT's); sequence parallelism's gathers and scatters (tp --sp runs); ZeRO-3's fetches, seconds waited on them; DDP's buckets, their
    in-flight union (the reducer's wait is not observable: the time the planner's compute leaves them)."""
    import glob
    import os
    from collections import defaultdict

    from nbtool.metrics import load
    from nbtool.plan.versus import typical_link_points

    own: dict = defaultdict(list)
    for d in dirs.split(","):
        for path in sorted(glob.glob(os.path.join(d, "*_plain.json"))):
            for row, point in typical_link_points(load(path)).items():
                own[row].append(point)
    return own


def fit_link(points: list) -> tuple[float, float]:
    """(alpha, B) such that count x alpha + bus bytes / B fits each point's seconds: least squares on
    log(predicted / measured), so that a typical step is predicted (least squares on the relative error
    came out 7-48% short at the median: blocked times are skewed by waits for the other rank)."""
    n, b, t = (np.array(x, dtype=float) for x in zip(*points))
    x, *_ = np.linalg.lstsq(np.column_stack([n / t, b / t]), np.ones(len(t)), rcond=None)
    log_alpha, log_inv_bw = np.log(max(x[0], 1e-7)), np.log(max(x[1], 1e-13))
    for _ in range(100):  # Gauss-Newton
        alpha, inv_bw = np.exp(log_alpha), np.exp(log_inv_bw)
        predicted = n * alpha + b * inv_bw
        jacobian = np.column_stack([n * alpha / predicted, b * inv_bw / predicted])
        step, *_ = np.linalg.lstsq(jacobian, np.log(t / predicted), rcond=None)
        log_alpha, log_inv_bw = log_alpha + step[0], log_inv_bw + step[1]
        if np.abs(step).max() < 1e-9:
            break
    return float(np.exp(log_alpha)), float(np.exp(-log_inv_bw))


def fit_links(own: dict) -> dict:
    """{row: (alpha, B)} for each row with 2 runs or more."""
    return {row: fit_link(points) for row, points in own.items() if len(points) >= 2}


def check_links(links: dict, own: dict) -> None:
    for row, (alpha, bw) in links.items():
        if errs := [(n * alpha + b / bw) / t - 1 for n, b, t in own.get(row, ())]:
            print(f"  {row}: median error {statistics.median(errs):+.1%}, median |error| "
                  f"{statistics.median(map(abs, errs)):.1%}, {sum(abs(e) <= 0.25 for e in errs)} of {len(errs)} "
                  f"within 25%, range {min(errs):+.0%}..{max(errs):+.0%}")


def main_links(dirs: str, check: str | None) -> None:
    own = _link_points(dirs)
    links = fit_links(own)
    print("COLLECTIVES = {")
    for op, (alpha, bw) in links.items():
        print(f'    "{op}": ({alpha * 1e6:.0f}e-6, {bw / 1e9:.3f}e9),')
    print("}")
    print("in sample (each run's typical step, per row):")
    check_links(links, own)
    if check:
        print("out of sample:")
        check_links(links, _link_points(check))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump", nargs="?", help="one --dump file, or several joined by commas")
    ap.add_argument("--links", metavar="DIR", help="fit cpu_costs.COLLECTIVES from the runs plan_accuracy --save wrote")
    ap.add_argument("--check", help="another dump (with --links: runs directory): the fitted model's errors "
                    "there (out of sample)")
    ap.add_argument("--all-runs", action="store_true", help="fit every run, not each strategy's median run")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="also predict each dump from the fit on the others (out of sample)")
    a = ap.parse_args()
    if a.links:
        return main_links(a.links, a.check)
    if not a.dump:
        ap.error("give a --dump file, or --links DIR")
    paths = a.dump.split(",")
    points = [p for path in paths for p in _points(path, a.all_runs)]
    costs, speeds = fit(points)
    print(f"S_PER_GFLOP = {costs['gflop'] * 1e3:.3g}e-3  # about {1 / costs['gflop']:.0f} GFLOP/s per rank")
    print("S_PER_TENSOR = {")
    for r, v in costs.items():
        if r != "gflop" and not r.endswith((" micro", " stage")):
            print(f'    "{r}": {v * 1e3:.3f}e-3,')
    print("}")
    for name, suffix in (("S_PER_TENSOR_MICROBATCH", " micro"), ("S_PER_MICROBATCH", " stage")):
        print(name + " = {" + ", ".join(f'"{r[:-len(suffix)]}": {v * 1e3:.3f}e-3' for r, v in costs.items()
                                        if r.endswith(suffix)) + "}")
    print("each set's host speed: " + ", ".join(f"{s} {v:.2f}" for s, v in speeds.items()))
    print("the median runs' time outside communication, each shape's calibrated on its fsdp run (fsdp on ddp):")
    report(f"  in sample ({len(points)} runs fitted)", calibrated_errors(points, costs))
    report("  cpu_costs' constants, same runs", calibrated_errors(points, current_costs()))
    if a.leave_one_out and len(paths) > 1:  # each set predicted by the fit on the others
        errs = []
        for path in paths:
            held, _ = fit([p for p in points if p["set"] != path])
            errs += calibrated_errors([p for p in points if p["set"] == path], held)
        report("  out of sample (each set by the fit on the others)", errs)
    if a.check:
        report("  out of sample (--check)", calibrated_errors(_points(a.check, True), costs))
    waits = sync_wait(paths)
    print("SYNC_WAIT = {" + ", ".join(f'"{row}": {v:.2f}' for row, v in waits.items()) + "}")
    if (sp := sp_host(paths)) is not None:
        print(f"S_PER_SP_COLLECTIVE = {sp * 1e3:.2f}e-3")


if __name__ == "__main__":
    main()
