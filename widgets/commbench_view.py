"""Live plot of a %commbench sweep: rows appear as rank 0 measures them."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots


class SweepPlot:
    def __init__(self, ops: list[str]):
        fig = make_subplots(rows=1, cols=2, subplot_titles=("time per call, rank 0, live (us)",
                                                            "bus bandwidth, rank 0, live (GB/s)"))
        for op in ops:
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=op, legendgroup=op), 1, 1)
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=op, legendgroup=op,
                                     showlegend=False), 1, 2)
        fig.update_xaxes(type="log", title_text="S (bytes)")
        fig.update_yaxes(type="log", row=1, col=1)
        fig.update_layout(height=360, margin=dict(t=40, l=40, r=20, b=40))
        self.fig = go.FigureWidget(fig)
        self.ops = list(ops)

    def show_rows(self, rows: list[dict], n: int) -> None:
        from nbtool.collectives import bandwidths

        with self.fig.hold_sync(), self.fig.batch_update():
            for i, op in enumerate(self.ops):
                pts = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size_bytes"])
                xs = [r["size_bytes"] for r in pts]
                self.fig.data[2 * i].x = self.fig.data[2 * i + 1].x = xs
                self.fig.data[2 * i].y = [r["seconds"] * 1e6 for r in pts]
                self.fig.data[2 * i + 1].y = [bandwidths(op, r["size_bytes"], n, r["seconds"])[1] / 1e9 for r in pts]

    def close(self) -> None:
        self.fig.close()


