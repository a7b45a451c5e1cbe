"""``%commbench`` plots: the live sweep (rows appear as rank 0 measures them) and a result's figure.

One colour per op (and per result when several are overlaid), the same in
both panels; byte axes tick at powers of 16 with binary units instead of
plotly's cluttered minor log labels.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbtool.collectives import bandwidths
from nbtool.commbench import BENCH_OPS

from .style import COLORS, bytes_ticks

DASHES = ("solid", "dash", "dot", "dashdot")


def op_color(op: str) -> str:
    return COLORS[BENCH_OPS.index(op) % len(COLORS)] if op in BENCH_OPS else COLORS[-1]


def _axes(fig: go.Figure, sizes: list[int]) -> None:
    vals, text = bytes_ticks(min(sizes, default=1), max(sizes, default=2**26))
    fig.update_xaxes(type="log", title_text="S (bytes)", tickvals=vals, ticktext=text, minor_showgrid=False)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(height=380, margin=dict(t=40, l=50, r=20, b=40), legend_font_size=11)
    fig.update_annotations(font_size=12)


class SweepPlot:
    """The sweep while it runs: rank 0's median so far per size, redrawn after every pass
    (nbtool.rank.commbench measures ``repeat`` passes over the sizes), the pass in the titles."""

    def __init__(self, ops: list[str], repeat: int = 1):
        fig = make_subplots(rows=1, cols=2, subplot_titles=self._titles("", repeat))
        for op in ops:
            c = op_color(op)
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=op, legendgroup=op, line_color=c), 1, 1)
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=op, legendgroup=op, line_color=c,
                                     showlegend=False), 1, 2)
        _axes(fig, [])
        self.fig = go.FigureWidget(fig)
        self.ops = list(ops)
        self.repeat = repeat

    @staticmethod
    def _titles(now: str, repeat: int) -> tuple[str, str]:
        live = f"rank 0, live, {now} of {repeat}" if now else "rank 0, live"
        return f"time per call, {live} (us)", f"bus bandwidth, {live} (GB/s)"

    def _now(self, rows: list[dict]) -> str:
        """"pass k" of the op being measured (the ops run one after another, in order)."""
        current = [op for op in self.ops if any(r["op"] == op for r in rows)][-1:]
        if not current:
            return ""
        done = max(len(r.get("samples", ())) for r in rows if r["op"] == current[0])
        return f"{current[0]} pass {done}" if len(self.ops) > 1 else f"pass {done}"

    def show_rows(self, rows: list[dict], n: int) -> None:
        with self.fig.batch_update():  # never inside hold_sync: the browser would get no update
            for note, text in zip(self.fig.layout.annotations, self._titles(self._now(rows), self.repeat)):
                note.text = text
            for i, op in enumerate(self.ops):
                pts = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size_bytes"])
                xs = [r["size_bytes"] for r in pts]
                self.fig.data[2 * i].x = self.fig.data[2 * i + 1].x = xs
                self.fig.data[2 * i].y = [r["seconds"] * 1e6 for r in pts]
                self.fig.data[2 * i + 1].y = [bandwidths(op, r["size_bytes"], n, r["seconds"])[1] / 1e9 for r in pts]

    def close(self) -> None:
        """Nothing to close: the FigureWidget stays open, unchanged (see Dashboard.close)."""


def result_figure(*results) -> go.Figure:
    """Latency (log-log, with the spread over repeats) and busbw against size for one or more
    CommbenchResults, overlaid."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time per call (us)", "bus bandwidth (GB/s)"))
    sizes = []
    for k, res in enumerate(results):
        for op in BENCH_OPS:
            pts = [r for r in res.rows if r["op"] == op]
            if not pts:
                continue
            name = f"{res.label or res.backend} {op}" if len(results) > 1 or res.label else op
            xs = [r["size_bytes"] for r in pts]
            sizes += xs
            line = dict(color=op_color(op), dash=DASHES[k % len(DASHES)])
            # the bars span the repeats' min..max around their median (the point)
            spread = dict(type="data", symmetric=False, thickness=1, width=3,
                          array=[(r.get("rep_max_s", r["seconds"]) - r["seconds"]) * 1e6 for r in pts],
                          arrayminus=[(r["seconds"] - r.get("rep_min_s", r["seconds"])) * 1e6 for r in pts])
            fig.add_trace(go.Scatter(x=xs, y=[r["seconds"] * 1e6 for r in pts], mode="lines+markers",
                                     name=name, legendgroup=name, line=line, error_y=spread), 1, 1)
            fig.add_trace(go.Scatter(x=xs, y=[r["busbw"] / 1e9 for r in pts], mode="lines+markers",
                                     name=name, legendgroup=name, showlegend=False, line=line), 1, 2)
    _axes(fig, sizes)
    return fig
