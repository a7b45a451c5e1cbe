"""``--memory-timeline`` plots: each rank's tracked tensor memory over the cell, stacked by category.

Consumes MemoryTimeline records only. Ranks side by side (one column each),
runs one row each, so strategies in ``%dist_compare`` line up: memory_viz
shows one snapshot file at a time.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbtool.metrics import RunRecords

from .style import COLORS

MIB = 2**20
# the profiler's own palette (torch.profiler._memory_profiler._CATEGORY_TO_COLORS), by name
CATEGORY_COLORS = {"parameter": "darkgreen", "optimizer_state": "goldenrod", "input": "black",
                   "temporary": "mediumpurple", "activation": "red", "gradient": "mediumblue",
                   "autograd_detail": "royalblue", "unknown": "grey"}


def timeline_figure(runs: list[RunRecords]) -> go.Figure:
    """One row per run that has timelines, one column per rank; stacked areas in MiB."""
    runs = [r for r in runs if r.timelines]
    cols = max(r.world_size for r in runs)
    titles = [f"{run.name}: rank {r}" for run in runs for r in range(cols)]
    fig = make_subplots(rows=len(runs), cols=cols, shared_yaxes=True, subplot_titles=titles,
                        horizontal_spacing=0.04, vertical_spacing=min(0.12, 0.3 / len(runs)))
    shown = set()
    for row, run in enumerate(runs, start=1):
        for t in sorted(run.timelines, key=lambda t: t.rank):
            for i, (cat, values) in enumerate(zip(t.categories, t.bytes)):
                if not any(values):
                    continue
                fig.add_trace(go.Scatter(
                    x=t.times, y=[v / MIB for v in values], name=cat, mode="lines", stackgroup=f"r{row}c{t.rank}",
                    line=dict(width=0.5, color=CATEGORY_COLORS.get(cat, COLORS[i % len(COLORS)])),
                    legendgroup=cat, showlegend=cat not in shown), row, t.rank + 1)
                shown.add(cat)
    fig.update_layout(height=260 * len(runs) + 120, margin=dict(t=70, l=50, r=15, b=40), font_size=11,
                      title=dict(text="tensor memory by category (tracked tensors, torch.profiler memory profile; "
                                      "MiB)", font_size=13),
                      legend=dict(orientation="h", y=-0.15 / len(runs), font_size=11))
    fig.update_xaxes(title_text="s since recording started", title_font_size=10)
    fig.update_annotations(font_size=12)
    return fig
