"""The live dashboard under a ``%%distributed STRATEGY`` cell.

Consumes RunRecords only. One plotly FigureWidget with six panels (a
seventh, the pipeline bubble per stage, for pp runs) whose
traces are created once and mutated in place inside plotly's
``batch_update()``: one update message per refresh. Never inside ipywidgets'
``hold_sync()``: plotly sends an update by setting ``_py2js_update`` and then
resetting it, and ``hold_sync`` would send only the reset, so the browser
would see nothing. The caller throttles refreshes. ``static()`` gives a plain
Figure copy to leave in the notebook.
"""
from __future__ import annotations

import html
import time

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbtool import run_analysis
from nbtool.collectives import OPS
from nbtool.metrics import LEDGER_CATEGORIES, RunRecords, format_bytes

from .style import COLORS, bytes_range, bytes_ticks

MIB = 2**20
# short titles: three panels share JupyterLab's default notebook width (~900 px)
PANELS = (
    "model state (ledger, MiB)", "process RSS (OS, MiB)", "loss (strategy.log)",
    "latency (ms): all_reduce", "bus bandwidth (GB/s) vs S", "rank 0 per step: comm, other (ms)",
)
LATENCY_PANEL = 3
MEMORY_PANEL = 1
LOSS_PANEL = 2
NO_LOSS = "loss (strategy.log): none yet"  # an empty panel says why it is empty
NO_LOSS_LOGGED = "loss (strategy.log): none logged"  # and once the run has ended (the static copy)
# the memory panel on CUDA ranks: the allocator's reserved bytes, and with NVML the driver's per-process
# bytes; the gap between the two lines is the memory outside PyTorch's allocator
CUDA_MEMORY_PANEL = "GPU (MiB): reserved, driver \u2504"

PIPELINE_PANEL = "pipeline: each stage's compute vs bubble per step (ms)"
TITLE_WRAP = 110  # characters per line of the static copy's title


class Dashboard:
    def __init__(self, world_size: int, title: str = "", refresh_s: float = 0.5, pipeline: bool = False,
                 cuda: bool = False):
        self.world_size = world_size
        self.cuda = cuda  # the memory panel plots allocator and driver figures instead of RSS
        self.pipeline = pipeline  # a third row: each stage's compute vs bubble
        self.refresh_s = refresh_s
        self._last = 0.0
        self.refreshes = 0
        rows = 3 if pipeline else 2
        specs = [[{}, {}, {}]] * 2 + ([[{"colspan": 3}, None, None]] if pipeline else [])
        titles = list(PANELS) + ([PIPELINE_PANEL] if pipeline else [])
        if cuda:
            titles[MEMORY_PANEL] = CUDA_MEMORY_PANEL
        fig = make_subplots(rows=rows, cols=3, specs=specs, subplot_titles=titles, horizontal_spacing=0.08,
                            vertical_spacing=0.14 if pipeline else 0.2)
        ranks = [f"rank {r}" for r in range(world_size)]
        for i, cat in enumerate(LEDGER_CATEGORIES):
            fig.add_trace(go.Bar(x=ranks, y=[0] * world_size, name=cat, marker_color=COLORS[i],
                                 legendgroup="ledger"), 1, 1)
        for r in range(world_size):
            c = COLORS[r % len(COLORS)]
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=f"rank {r} {'reserved' if cuda else 'rss'}",
                                     line_color=c, showlegend=False), 1, 2)
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=f"rank {r} loss", line_color=c,
                                     showlegend=False), 1, 3)
            fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name=f"rank {r} latency", marker_color=c,
                                     marker_size=4, showlegend=False), 2, 1)
        for r in range(world_size):  # NVML's per-process bytes (CUDA ranks with nvidia-ml-py; empty otherwise)
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=f"rank {r} driver (NVML)",
                                     line=dict(color=COLORS[r % len(COLORS)], dash="dot"), showlegend=False), 1, 2)
        for i, op in enumerate(OPS[:-1]):
            fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name=op, marker_symbol="diamond",
                                     marker_color=COLORS[i % len(COLORS)], legendgroup="ops"), 2, 2)
        fig.add_trace(go.Bar(x=[], y=[], name="step: comm (busy: union of in-flight)", marker_color="#333333",
                             legendgroup="step"), 2, 3)
        fig.add_trace(go.Bar(x=[], y=[], name="step: other (compute, data, optimizer)", marker_color="#c8c8c8",
                             legendgroup="step"), 2, 3)
        self._step_traces = (len(fig.data) - 2, len(fig.data) - 1)
        if pipeline:
            stages = [f"rank {r}" for r in range(world_size)]
            fig.add_trace(go.Bar(x=stages, y=[0] * world_size, name="stage compute", marker_color="#00cc96"), 3, 1)
            fig.add_trace(go.Bar(x=stages, y=[0] * world_size, name="bubble (idle, send/recv)",
                                 marker_color="#d3d3d3"), 3, 1)
        fig.update_layout(barmode="stack", height=640 + (260 if pipeline else 0),
                          margin=dict(t=70, l=45, r=15, b=40), title=dict(text=title, font_size=13),
                          legend=dict(orientation="h", y=-0.12, font_size=11, traceorder="normal"), font_size=11)
        fig.update_annotations(font_size=12)  # the subplot titles
        fig.update_xaxes(title_font_size=10, title_standoff=2)
        vals, text = bytes_ticks(1, 2**32)
        fig.update_xaxes(type="log", title_text="S (bytes)", tickvals=vals, ticktext=text, row=2, col=2)
        self._bus_axis = fig.get_subplot(2, 2).xaxis.plotly_name  # its ticks follow the sizes (refresh)
        self._bus_span = None
        fig.update_xaxes(title_text="s since start", row=1, col=2)
        fig.update_xaxes(title_text="step", row=1, col=3)
        fig.update_xaxes(title_text="s since start", row=2, col=1)
        fig.update_xaxes(title_text="step", row=2, col=3)
        self.fig = go.FigureWidget(fig)
        self.op = W.Dropdown(options=list(OPS[:-1]), value="all_reduce", description="latency op",
                             layout=W.Layout(width="240px"))
        self.status = W.HTML(layout=W.Layout(flex="1 1 auto"))
        self.widget = W.VBox([W.HBox([self.op, self.status]), self.fig])
        self._run: RunRecords | None = None
        self._op_chosen = False  # once the user picks an op, keep it
        self._setting = False
        self.op.observe(self._on_op, names="value")

    def _on_op(self, change):
        if self._setting:
            return
        self._op_chosen = True
        if self._run is not None:
            self.refresh(self._run, force=True)

    def refresh(self, run: RunRecords, force: bool = False) -> bool:
        """Redraw from ``run`` if ``refresh_s`` has passed (or ``force``); True if it drew."""
        now = time.monotonic()
        self._run = run
        if not force and now - self._last < self.refresh_s:
            return False
        self._last = now
        t0 = run.t_start
        traces = self.fig.data
        n = self.world_size
        ncat = len(LEDGER_CATEGORIES)
        ledgers = [run_analysis.peak_ledger(run, r) for r in range(n)]
        ops_seen = sorted({c.op for c in run.comms} & set(self.op.options))  # barriers have no latency plot
        if not self._op_chosen and ops_seen and self.op.value not in ops_seen:
            self._setting = True
            self.op.value = "all_reduce" if "all_reduce" in ops_seen else ops_seen[0]
            self._setting = False
        op = self.op.value
        steps = run_analysis.step_table(run, 0)
        spread = run_analysis.straggler_spread(run)
        with self.fig.batch_update():  # one plotly update message (see the module docstring)
            for i, cat in enumerate(LEDGER_CATEGORIES):
                traces[i].y = [ledgers[r][cat] / MIB for r in range(n)]
            for r in range(n):
                mem = [m for m in run.memory if m.rank == r]
                if self.cuda:
                    mem = [m for m in mem if m.cuda_reserved is not None]
                traces[ncat + 3 * r].x = [m.t - t0 for m in mem]
                traces[ncat + 3 * r].y = [(m.cuda_reserved if self.cuda else m.rss) / MIB for m in mem]
                driver = [m for m in mem if self.cuda and m.driver_used is not None]
                traces[ncat + 3 * n + r].x = [m.t - t0 for m in driver]
                traces[ncat + 3 * n + r].y = [m.driver_used / MIB for m in driver]
                loss = [s for s in run.scalars if s.rank == r and "loss" in s.values]
                traces[ncat + 3 * r + 1].x = [s.step for s in loss]
                traces[ncat + 3 * r + 1].y = [s.values["loss"] for s in loss]
                lat = [c for c in run.comms if c.rank == r and c.op == op]
                traces[ncat + 3 * r + 2].x = [c.t_issue - t0 for c in lat]
                traces[ncat + 3 * r + 2].y = [c.seconds * 1e3 for c in lat]
            base = ncat + 4 * n
            sizes = []
            for i, name in enumerate(OPS[:-1]):
                cs = [c for c in run.comms if c.op == name and c.size_bytes > 0 and c.seconds > 0]
                traces[base + i].x = [c.size_bytes for c in cs]
                traces[base + i].y = [c.busbw / 1e9 for c in cs]
                sizes += [c.size_bytes for c in cs]  # (not the trace's x: batch_update applies it later)
            if sizes and (min(sizes), max(sizes)) != self._bus_span:
                # ticks around the sizes seen: a few sizes within 16x of each other fell between the
                # fixed powers of 16, and the axis showed no size at all
                self._bus_span = (min(sizes), max(sizes))
                vals, text = bytes_ticks(*self._bus_span)
                self.fig.layout[self._bus_axis].update(tickvals=vals, ticktext=text, range=bytes_range(vals))
            comm, other = (traces[i] for i in self._step_traces)
            comm.x = other.x = [s["step"] for s in steps]
            comm.y = [s["comm_s"] * 1e3 for s in steps]
            other.y = [s["compute_s"] * 1e3 for s in steps]
            if self.pipeline:
                self._refresh_bubble(run)
            self.fig.layout.annotations[LATENCY_PANEL].text = f"latency (ms): {op}"
            logged = any("loss" in s.values for s in run.scalars)
            self.fig.layout.annotations[LOSS_PANEL].text = PANELS[LOSS_PANEL] if logged else NO_LOSS
        self.status.value = self._status_html(run, spread)
        self.refreshes += 1
        return True

    def _refresh_bubble(self, run: RunRecords) -> None:
        rows = run_analysis.bubble_table(run)
        if not rows:
            return
        compute, idle = self.fig.data[-2], self.fig.data[-1]
        compute.x = idle.x = [f"rank {r['rank']} (stage {r['stage']})" for r in rows]
        compute.y = [r["compute_s"] * 1e3 for r in rows]
        idle.y = [r["idle_s"] * 1e3 for r in rows]
        idle.text = [f"{r['bubble']:.0%} idle" for r in rows]
        r0 = rows[0]
        self.fig.layout.annotations[len(PANELS)].text = (
            f"{PIPELINE_PANEL}: {r0['schedule']}, {r0['microbatches']} micro-batches, "
            f"theory for equal stages {r0['theory']:.0%}")

    def _status_html(self, run: RunRecords, spread) -> str:
        return "<span style='font-family:monospace'>" + html.escape(self.status_text(run, spread)) + "</span>"

    @staticmethod
    def status_text(run: RunRecords, spread=None) -> str:
        """One line: counts, the straggler spread, and which clock timed the collectives."""
        if spread is None:
            spread = run_analysis.straggler_spread(run)
        n_steps = max((m.step for m in run.steps), default=0)
        parts = [f"{len(run.comms)} collectives recorded", f"{n_steps} optimizer steps"]
        bubble = run_analysis.bubble_table(run)
        if bubble:
            parts.append("pipeline bubble " + ", ".join(f"stage {r['stage']} {r['bubble']:.0%}" for r in bubble)
                         + f" (theory {bubble[0]['theory']:.0%})")
        if spread:
            worst = max(spread, key=lambda s: s[2])
            med = sorted(s[2] for s in spread)[len(spread) // 2]
            parts.append(f"straggler: ranks entered the same collective up to {worst[2] * 1e3:.1f} ms apart "
                         f"({worst[1]} #{worst[0]}; median {med * 1e3:.2f} ms)")
        clocks = sorted({c.clock for c in run.comms})
        if clocks:
            parts.append(f"latency clock: {', '.join(clocks)}")
        outside = run_analysis.outside_allocator(run.memory)
        if outside:
            parts.append("outside PyTorch's allocator (driver minus reserved): " + ", ".join(
                f"rank {r} {format_bytes(b)}" for r, b in sorted(outside.items())))
        return " · ".join(parts)

    def static(self, run: RunRecords | None = None) -> go.Figure:
        """A plain Figure with the current data (for a static copy in the notebook).

        With ``run``, the title carries the status line, wrapped so that it
        fits the figure's width.
        """
        fig = go.Figure(self.fig)
        if fig.layout.annotations[LOSS_PANEL].text == NO_LOSS:
            fig.layout.annotations[LOSS_PANEL].text = NO_LOSS_LOGGED
        if run is not None:
            title = wrap_title(f"{run.name}: {self.status_text(run)}")
            fig.update_layout(title=dict(text=title, font_size=12, yref="container", y=1, yanchor="top",
                                         pad_t=12), margin_t=60 + 16 * title.count("<br>"))
        return fig

    def close(self) -> None:
        """Close the controls; leave the FigureWidget alone.

        Its view is gone (replaced by the static copy), but plotly.js keeps
        handlers for it in the page: closing its comm makes a later resize sync a
        closed model ("Syncing error: no comm channel defined"), and updating it
        makes the page draw into a removed element ("el.on is not a function").
        So it stays open, unchanged, until the kernel ends: its memory (the
        final data, ~30 bytes a point) is the price.
        """
        for w in (self.widget, self.widget.children[0], self.op, self.status):
            w.close()


def wrap_title(text: str, width: int = TITLE_WRAP) -> str:
    """``text`` broken at " · " separators (or spaces) into lines of at most ``width`` characters."""
    lines, line = [], ""
    for part in text.replace(" · ", " ·\0").split("\0"):
        if line and len(line) + len(part) > width:
            lines.append(line.rstrip())
            line = ""
        line += part
    lines.append(line)
    return "<br>".join(html.escape(x) for x in lines)
