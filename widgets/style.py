"""Shared look of nbtool's plots: one palette, and byte axes that read well."""
from __future__ import annotations

from nbtool.metrics import format_bytes

COLORS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880")


def bytes_ticks(lo: float = 1, hi: float = 2**30) -> tuple[list[int], list[str]]:
    """Tick values at powers of 16 covering [lo, hi], labelled in binary units.

    Plotly's default log axis labels every 2 and 5 in between ("100k 2 5 1M"),
    which crowds narrow panels and reads as decimal sizes.
    """
    vals, v = [], 1
    while v <= max(hi, 1) * 16:
        if v * 16 >= lo:
            vals.append(v)
        v *= 16
    return vals, [format_bytes(x).replace(".00 ", " ").replace(".0 ", " ") for x in vals]
