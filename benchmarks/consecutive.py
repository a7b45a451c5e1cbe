"""Does a ratio benchmark decide anything? Run it several times in a row and compare its medians.

A benchmark whose median moves between runs by more than its target's margin
decides nothing, so each ratio benchmark here must print medians within +-3%
of each other in consecutive runs. This runs one benchmark script ``--runs``
times (default 3) one after the other, each as its own process with the
arguments given after ``--``, and collects every figure it prints: the
``NAME: median X of N pairs`` lines of ``_paired.ratio_line`` and the final
``name=value`` lines (one that repeats a paired line's values is shown
once). Per figure it prints the runs' values, their range
(max / min - 1) and whether each run lies within +-3% of the middle run's
value (the median of the runs), the reading of "within +-3% of each other"
judged here.

    .venv/bin/python benchmarks/consecutive.py dispatch.py
    .venv/bin/python benchmarks/consecutive.py strategy_overhead.py -- --rounds 9
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.03
_PAIRED = re.compile(r"^(?P<name>[^:]+): median (?P<value>[0-9.]+) of (?P<pairs>\d+) pairs")
_FINAL = re.compile(r"^(?P<name>[a-z_]+)=(?P<value>[0-9.]+)")


def figures(output: str) -> dict[str, float]:
    """Every figure one run printed, by name, in the order printed."""
    found = {}
    for line in output.splitlines():
        m = _PAIRED.match(line) or _FINAL.match(line)
        if m:
            found[m["name"].strip()] = float(m["value"])
    return found


def judge(values: list[float], tolerance: float = TOLERANCE) -> tuple[float, bool]:
    """(max / min - 1, whether every value is within +-tolerance of the values' median)."""
    middle = statistics.median(values)
    return max(values) / min(values) - 1, all(abs(v / middle - 1) <= tolerance for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(usage="%(prog)s SCRIPT [--runs N] [-- ARGS FOR THE SCRIPT]")
    ap.add_argument("script", help="a benchmark in benchmarks/, e.g. dispatch.py")
    ap.add_argument("--runs", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, rest = ap.parse_args(argv[:cut]), argv[cut + 1:]
    script = HERE / a.script
    if not script.is_file() or script.suffix != ".py":
        ap.error(f"{a.script}: not a benchmark script in {HERE}")
    if a.runs < 2:
        ap.error(f"--runs {a.runs}: must be >= 2")
    runs = []
    for i in range(a.runs):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(script), *rest], cwd=HERE, capture_output=True, text=True)
        print(f"--- run {i + 1} of {a.runs} ({time.perf_counter() - t0:.0f} s, exit {out.returncode})")
        print(out.stdout.rstrip(), flush=True)
        if out.returncode != 0:
            sys.exit(f"run {i + 1} failed:\n" + "\n".join(out.stderr.strip().splitlines()[-10:]))
        runs.append(figures(out.stdout))
    names, seen = [], set()
    for n in runs[0]:  # a final name=value line repeating a paired line's median is shown once
        values = tuple(r.get(n) for r in runs)
        if None not in values and values not in seen:
            names.append(n)
            seen.add(values)
    if not names:
        sys.exit(f"{a.script} printed no figure in every run (a '... median X of N pairs' or 'name=value' line)")
    print(f"\n{a.script} {' '.join(rest)}: {a.runs} consecutive runs")
    width = max(len(n) for n in names)
    for name in names:
        values = [r[name] for r in runs]
        spread, ok = judge(values)
        print(f"{name:{width}}  {' / '.join(f'{v:.3f}' for v in values)}  range {spread:.1%}  "
              f"{'within' if ok else 'NOT within'} +-{TOLERANCE:.0%} of the middle run")


if __name__ == "__main__":
    main()
