"""How every ratio benchmark reports: the median of paired, interleaved repetitions and its spread.

Arm A (nbtool) and arm B (the baseline) run alternately, in alternating order,
on the same warm processes where possible; each pair gives one ratio A/B, so
drift on a noisy machine hits both arms of a pair alike. A benchmark prints
the median of at least 5 per-pair ratios, their min..max, and whether the
target is met with that spread (met: even the worst pair is inside the
target; met at the median: the median is, the worst pair is not).
"""
from __future__ import annotations

import statistics

MIN_PAIRS = 5


def alternate(rounds: int, arm_a, arm_b) -> tuple[list, list]:
    """Run the arms ``rounds`` times each, A first on even rounds and B first on odd ones."""
    a, b = [], []
    for i in range(rounds):
        if i % 2 == 0:
            a.append(arm_a())
            b.append(arm_b())
        else:
            b.append(arm_b())
            a.append(arm_a())
    return a, b


def ratio_line(name: str, a: list[float], b: list[float], target: float, lower_is_better: bool = True) -> float:
    """Print ``name``'s median per-pair ratio, its spread and the verdict; return the median."""
    pairs = [x / y for x, y in zip(a, b)]
    median = statistics.median(pairs)
    worst = max(pairs) if lower_is_better else min(pairs)
    inside = (lambda r: r <= target) if lower_is_better else (lambda r: r >= target)
    verdict = ("met" if inside(worst) else "met at the median, not by every pair" if inside(median)
               else "NOT met")
    few = "" if len(pairs) >= MIN_PAIRS else f" (only {len(pairs)} pairs: use >= {MIN_PAIRS})"
    print(f"{name}: median {median:.3f} of {len(pairs)} pairs, spread {min(pairs):.3f}..{max(pairs):.3f}; "
          f"target {'<=' if lower_is_better else '>='} {target:g}: {verdict}{few}")
    return median
