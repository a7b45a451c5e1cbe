"""Side-by-side comparison of runs (strategies): a table with ratios to the first, and plots.

Consumes RunRecords (through nbtool.run_analysis summaries) only.
"""
from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbtool import run_analysis
from nbtool.metrics import RunRecords, format_bytes

MIB = 2**20
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def _op_bytes(op: str, b: float) -> str:
    # MiB keeps the column comparable; a few bytes (a loss all_reduce) would read 0.000
    return f"{op} {b / MIB:.3f}" if b >= 0.0005 * MIB else f"{op} {format_bytes(b)}"


def _ratio(x, base) -> str:
    return f"x{x / base:.2f}" if base and x else "-"  # "-": a figure this run or every run lacks


def _first(values: list) -> float:
    return next((v for v in values if v), 0)


class Comparison:
    """``%dist_compare`` / ``%%distributed compare``: rows in run order; ratios are to the first run
    that has the figure (a run that recorded no model or no steps is skipped as a base).

    Deterministic columns (for a fixed model, data and world size): model-state
    bytes (the ledger, max over ranks) and communication bytes per step (bus
    bytes, and S per op). Counts, times and RSS can vary run to run.
    """

    def __init__(self, runs: list[RunRecords]):
        self.runs = runs
        self.rows = [run_analysis.summary(r) for r in runs]

    def _cells(self, deterministic: bool) -> tuple[list[str], list[list[str]]]:
        # each ratio is to the first run that has the figure: a cell that recorded no model or no
        # steps (no strategy.prepare, a failed run) would otherwise blank the whole column
        bmax = _first([max(row["model_state_bytes"].values() or [0]) for row in self.rows])
        bbus = _first([row["bus_bytes_per_step"] for row in self.rows])
        bstep = _first([row["step_s"] for row in self.rows])
        cols = ["run", "model state MiB (max rank)", "vs first", "comm bus MiB/step", "vs first",
                "by op: S MiB/step"]
        compiled = any(row["compile_s"] for row in self.rows)
        if not deterministic:
            cols += ["collectives/step", "peak RSS MiB", "step ms (mean)", "vs first", "comm busy ms/step",
                     "comm exposed ms/step", "final loss"] + (["compile s"] if compiled else [])
        out = []
        for row in self.rows:
            ms = max(row["model_state_bytes"].values() or [0])
            bus = row["bus_bytes_per_step"]
            cells = [row["name"], f"{ms / MIB:.3f}", _ratio(ms, bmax), f"{bus / MIB:.3f}", _ratio(bus, bbus),
                     ", ".join(_op_bytes(op, b) for op, b in row["comm_bytes_per_step"].items()) or "-"]
            if not deterministic:
                cells += [f"{sum(row['collectives_per_step'].values()):.1f}",
                          f"{max(row['peak_rss'].values() or [0]) / MIB:.0f}", f"{row['step_s'] * 1e3:.1f}",
                          _ratio(row["step_s"], bstep), f"{row['comm_s_per_step'] * 1e3:.1f}",
                          "-" if row["exposed_s_per_step"] is None else f"{row['exposed_s_per_step'] * 1e3:.1f}",
                          "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"]
                cells += [f"{row['compile_s']:.1f}" if row["compile_s"] else "-"] if compiled else []
            out.append(cells)
        return cols, out

    def text(self, deterministic: bool = False) -> str:
        cols, rows = self._cells(deterministic)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        cols, rows = self._cells(False)
        # compact enough for 13 columns in JupyterLab's output (833 px at a 1280 px window: the table had
        # run 120 px past it, its last two columns behind a scrollbar): less padding, a header may break
        # after a "/", and each op of the "by op" cell on its own line
        pad = "padding:2px 4px"
        head = "".join(f"<th style='{pad}'>{html.escape(c).replace('/', '/<wbr>')}</th>" for c in cols)
        by_op = cols.index("by op: S MiB/step")
        body = "".join("<tr>" + "".join(
            f"<td style='{pad}{';white-space:nowrap' if i == by_op else ''}'>"
            + ("<br>".join(map(html.escape, c.split(", "))) if i == by_op else html.escape(c)) + "</td>"
            for i, c in enumerate(r)) + "</tr>" for r in rows)
        note = ("model state = bytes of parameters, gradients, master copies and optimizer state each rank owns "
                "(ledger, not RSS); comm bus bytes = S x the nccl-tests bus factor of each collective issued per "
                "optimizer step (what each rank sends/receives; mean of steps 2..N, rank 0), S by op as nccl-tests "
                "defines it; times are wall time on rank 0, means of steps 2..N (the planner's error on the step "
                "time, below the table, is against their median, which a stalled step moves less; a run whose "
                "--memory-timeline stopped at --timeline-steps K with 2 or more steps after: steps K+1..N for "
                "every per-step figure); comm busy = "
                "the union of the collectives' in-flight intervals within each step (overlapping async collectives count once); comm exposed = the part of it the "
                "training thread was blocked on (blocking collectives whole, async ones while waited; '-' where that "
                "is not observable: DDP's reducer waits inside C++, CUDA ranks time the device); ratios are to the "
                "first run that has the figure" + ("; compile s = seconds torch.compile spent on rank 0 (dynamo's start to end callbacks), "
                                 "its steps left out of the step times" if any(r["compile_s"] for r in self.rows)
                                 else ""))
        return (f"<table class='nbtool-compare' style='font-size:11px'><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>"
                f"<p style='font-size:smaller'>{html.escape(note)}</p>")

    def figure(self) -> go.Figure:
        fig = make_subplots(rows=1, cols=3, subplot_titles=(
            "model state per rank (ledger, MiB)", "collective latency by op (ms)", "loss, rank 0"))
        curves: list[tuple[str, list]] = []  # earlier runs' loss curves, to say when one coincides
        for i, (run, row) in enumerate(zip(self.runs, self.rows)):
            color = f"hsl({(i * 137) % 360},60%,50%)"
            fig.add_trace(go.Bar(x=[f"rank {r}" for r in row["model_state_bytes"]],
                                 y=[b / MIB for b in row["model_state_bytes"].values()],
                                 name=row["name"], marker_color=color, legendgroup=row["name"]), 1, 1)
            comms = [c for c in run.comms if c.seconds > 0]
            fig.add_trace(go.Box(x=[c.op for c in comms], y=[c.seconds * 1e3 for c in comms], name=row["name"],
                                 marker_color=color, legendgroup=row["name"], showlegend=False), 1, 2)
            loss = [s for s in run.scalars if s.rank == 0 and "loss" in s.values]
            ys = [s.values["loss"] for s in loss]
            same = next((name for name, other in curves if _same_curve(ys, other)), None)
            curves.append((row["name"], ys))
            # identical curves would hide each other: dashes differ, and the legend says they coincide
            label = f"{row['name']} (loss = {same})" if same else row["name"]
            fig.add_trace(go.Scatter(x=[s.step for s in loss], y=ys, mode="lines", name=label,
                                     line=dict(color=color, dash=DASHES[i % len(DASHES)], width=2 + (i == 0)),
                                     legendgroup=row["name"], showlegend=bool(same)), 1, 3)
        fig.update_layout(barmode="group", boxmode="group", height=420, margin=dict(t=50, l=40, r=20, b=40),
                          font_size=11, legend_font_size=11)
        fig.update_annotations(font_size=12)
        fig.update_yaxes(type="log", row=1, col=2)
        return fig


def _same_curve(a: list, b: list, rel: float = 1e-6) -> bool:
    return bool(a) and len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))
