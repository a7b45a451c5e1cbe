"""Shared look of nbtool's plots: one palette, and byte axes that read well."""
from __future__ import annotations

import math

from nbtool.metrics import format_bytes

COLORS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880")


def bytes_ticks(lo: float = 1, hi: float = 2**30) -> tuple[list[int], list[str]]:
    """Tick values at powers of 16 covering [lo, hi] (of 4 or 2 where the sizes span less than 64x or 8x,
    so that a narrow span still gets ticks around it), labelled in binary units.

    Plotly's default log axis labels every 2 and 5 in between ("100k 2 5 1M"),
    which crowds narrow panels and reads as decimal sizes.
    """
    lo, hi = max(lo, 1), max(hi, lo, 1)
    step = 16 if hi / lo >= 64 else 4 if hi / lo >= 8 else 2
    vals, v = [], 1
    while True:  # from the last tick at or below lo to the first at or above hi
        if v * step > lo:
            vals.append(v)
        if v >= hi:
            break
        v *= step
    if len(vals) < 2:  # lo == hi on a tick
        vals.append(vals[-1] * step)
    return vals, [format_bytes(x).replace(".00 ", " ").replace(".0 ", " ") for x in vals]


def bytes_range(vals: list[int]) -> list[float]:
    """A log axis's range (log10 units) from the first tick of ``bytes_ticks`` to its last, and a little
    more (a marker on an end tick stays whole): the sizes between, each tick in sight (plotly's own
    range stops near the data, short of the ticks around it)."""
    lo, hi = math.log10(vals[0]), math.log10(vals[-1])
    pad = 0.04 * (hi - lo)
    return [lo - pad, hi + pad]
