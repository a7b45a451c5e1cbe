"""The strategy picker: inputs -> predicted memory and communication per layout -> a ranked choice.

Consumes planner objects only (nbtool.plan). "Apply" inserts a new cell below
the picker holding the chosen ``%%distributed`` line, at once, through
JupyterLab's own commands (``notebook:insert-cell-below`` then
``notebook:replace-selection``, reached with ipylab's front-end extension; the
click has made the picker's cell the active one). A kernel cannot add a cell
from a widget callback by itself: IPython's ``set_next_input`` is delivered
only with the next execute reply. Where the front end has no ipylab (VS Code,
classic Notebook), Apply says so and uses ``set_next_input``, so the cell
appears when the next cell runs; the line is shown to copy either way.
"Export DeepSpeed config" writes the JSON that line would use.
"""
from __future__ import annotations

import contextlib
import html

import ipywidgets as W
import plotly.graph_objects as go

from . import front_end
from plotly.subplots import make_subplots

from nbtool.plan.estimate import RESERVE
from nbtool.plan.layouts import PREFERENCE
from nbtool.plan.inputs import GB, HARDWARE_PRESETS, MODEL_PRESETS, Hardware, ModelShape, Training
from nbtool.plan.recommend import _label, emulated_bf16_note, recommend, runnable_choices

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "workspace")
COLORS = ("#636efa", "#ef553b", "#ab63fa", "#00cc96", "#ffa15a", "#8c8c8c")


class Picker:
    def __init__(self, hardware: Hardware | None = None, model: str = "GPT-2 small (124M)", shell=None,
                 shape: ModelShape | None = None, measured: str = ""):
        self.shell = shell
        # which of ``hardware``'s figures this cluster measured (%dist_plan --text prints the same line),
        # shown while that hardware is selected
        self.measured = measured if hardware is not None else ""
        self._measured_hw = hardware.name if hardware is not None else None
        # the user's own model (%dist_plan --model VAR), counted, is offered first under its name
        self.model_presets = {shape.name: shape, **MODEL_PRESETS} if shape is not None else dict(MODEL_PRESETS)
        if shape is not None:
            model = shape.name
        self.hw_presets = dict(HARDWARE_PRESETS)
        if hardware is not None:
            self.hw_presets = {hardware.name: hardware, **self.hw_presets}
        first_hw = next(iter(self.hw_presets.values()))
        style = {"description_width": "95px"}
        def lay():  # one Layout per widget: hiding one input must not hide the others
            return W.Layout(width="250px")
        self.model = W.Dropdown(options=list(self.model_presets) + ["custom"], value=model, description="model",
                                style=style, layout=lay())
        self.custom_params = W.FloatText(value=1.0, description="params (B)", style=style, layout=lay())
        self.hardware = W.Dropdown(options=list(self.hw_presets), value=first_hw.name, description="hardware",
                                   style=style, layout=lay())
        self.devices = W.IntText(value=first_hw.devices, description="devices", style=style, layout=lay())
        self.memory = W.FloatText(value=round(first_hw.device_memory / GB, 1), description="device GB",
                                  style=style, layout=lay())
        self.precision = W.Dropdown(options=["bf16", "fp16", "fp32"], value="bf16", description="precision",
                                    style=style, layout=lay())
        self.micro_batch = W.IntText(value=1, description="micro-batch", style=style, layout=lay())
        self.seq = W.IntText(value=0, description="seq (0: model)", style=style, layout=lay())
        self.checkpointing = W.Dropdown(options=["none", "selective", "full"], value="none",
                                        description="checkpointing", style=style, layout=lay())
        # grows into the row but may shrink below its longest option (a select is as wide as that by
        # default, which pushed Apply out of JupyterLab's output area at a 1280 px window)
        self.choice = W.Dropdown(options=[], description="run", style={"description_width": "40px"},
                                 layout=W.Layout(flex="1 1 auto", width="auto", min_width="0"))
        self.apply_button = W.Button(description="Apply: new cell below", button_style="primary",
                                     layout=W.Layout(width="190px", flex="0 0 auto"))
        self.export_path = W.Text(value="ds_config.json", description="config file", style=style, layout=lay())
        self.export_button = W.Button(description="Export DeepSpeed config", layout=W.Layout(width="210px"))
        self.message = W.HTML()
        # the chosen line whole, wrapped: the dropdown shows as much of it as its width holds (a 7B model's
        # FSDP line ends "--activa" at a 1280 px window)
        self.chosen = W.HTML()
        self.ranking = W.HTML()
        # halves: at 0.62 / 0.38 the communication chart had room for every other layout's name only
        fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.08,
                            subplot_titles=("predicted memory per device (GB)", "communication per step (bus GB)"))
        for cat, color in zip(CATEGORIES, COLORS):
            fig.add_trace(go.Bar(x=[], y=[], name=cat, marker_color=color), 1, 1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=f"usable ({1 - RESERVE:.0%} of device)",
                                 line=dict(color="black", dash="dash")), 1, 1)
        fig.add_trace(go.Bar(x=[], y=[], name="comm", marker_color="#19d3f3", showlegend=False), 1, 2)
        # the legend's two rows sit below plotly's toolbar (at t=80 the toolbar covered "activations")
        fig.update_layout(barmode="stack", height=490, margin=dict(t=110, l=40, r=10, b=130), font_size=11,
                          legend=dict(orientation="h", yanchor="bottom", y=1.1, x=0, font_size=10))
        fig.update_annotations(font_size=12)
        fig.update_xaxes(tickangle=-40, tickfont_size=10)
        self.fig = go.FigureWidget(fig)
        self._quiet = False
        self._app = front_end.app()
        self.updates = 0
        self.recommendation = None
        for w in (self.model, self.custom_params, self.devices, self.memory, self.precision, self.micro_batch,
                  self.seq, self.checkpointing):
            w.observe(lambda _: self.update(), names="value")
        self.hardware.observe(self._hardware_changed, names="value")
        self.apply_button.on_click(lambda _: self.apply())
        self.export_button.on_click(lambda _: self.export())
        self.model.observe(lambda _: self._show_custom(), names="value")
        self.choice.observe(lambda _: self._show_chosen(), names="value")
        # inputs in a grid above a full-width chart: fits JupyterLab's default width and wider ones
        inputs = W.GridBox([self.model, self.custom_params, self.hardware, self.devices, self.memory,
                            self.precision, self.micro_batch, self.seq, self.checkpointing],
                           layout=W.Layout(grid_template_columns="repeat(auto-fill, minmax(255px, 1fr))",
                                           width="100%"))
        actions = W.VBox([W.HBox([self.choice, self.apply_button], layout=W.Layout(width="100%")), self.chosen,
                          W.HBox([self.export_path, self.export_button]), self.message])
        self.widget = W.VBox([inputs, self.fig, self.ranking, actions], layout=W.Layout(width="100%"))
        self._show_custom()
        self.update()

    def _show_custom(self) -> None:
        self.custom_params.layout.display = None if self.model.value == "custom" else "none"

    @contextlib.contextmanager
    def quiet(self):
        """Set several inputs without a chart update for each; call update() after."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def show(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- inputs -> planner objects -------------------------------------------
    def model_shape(self) -> ModelShape:
        if self.model.value == "custom":
            return ModelShape(int(self.custom_params.value * 1e9), name=f"{self.custom_params.value:g}B params")
        return self.model_presets[self.model.value]

    def hardware_now(self) -> Hardware:
        from dataclasses import replace

        hw = self.hw_presets[self.hardware.value].with_devices(max(1, self.devices.value))
        return replace(hw, device_memory=max(0.1, self.memory.value) * GB)

    def training(self) -> Training:
        return Training(micro_batch=max(1, self.micro_batch.value), seq=self.seq.value or None,
                        precision=self.precision.value, checkpointing=self.checkpointing.value)

    def _hardware_changed(self, change) -> None:
        hw = self.hw_presets[change["new"]]
        with self.quiet():
            self.devices.value = hw.devices
            self.memory.value = round(hw.device_memory / GB, 1)
        self.update()

    # -- planner -> view ------------------------------------------------------------
    def update(self) -> None:
        if self._quiet:
            return
        shape, training, hw = self.model_shape(), self.training(), self.hardware_now()
        rec = recommend(shape, training, hw)
        self.recommendation = rec
        ests = sorted(rec.ranked + rec.rejected, key=lambda e: PREFERENCE.index(e.layout))
        names = [_label(e) for e in ests]
        with self.fig.batch_update():  # never inside hold_sync: the browser would get no update
            for i, cat in enumerate(CATEGORIES):
                self.fig.data[i].x = names
                self.fig.data[i].y = [e.device.get(cat, 0) / GB for e in ests]
            usable = (1 - RESERVE) * hw.device_memory / GB
            self.fig.data[len(CATEGORIES)].x = names
            self.fig.data[len(CATEGORIES)].y = [usable] * len(names)
            self.fig.data[-1].x = names
            self.fig.data[-1].y = [e.comm_bus_bytes / GB for e in ests]
        runnable = runnable_choices(rec, training)
        options = [(f"{_label(e)}: %%distributed {e.magic_line(training)}", i) for i, e in enumerate(runnable)]
        self._runnable = runnable
        self.choice.options = options
        self.choice.value = 0 if options else None
        self._show_chosen()  # the value may stay 0 while the line at 0 changed
        items = "".join(f"<li>{html.escape(line)}</li>" for line in rec.lines())
        # CPU ranks that emulate bf16: say so above the ranking, with fp32's predicted step
        note = emulated_bf16_note(shape, training, hw, rec)
        note = f"<p class='nbtool-note' style='font-size:smaller'>note: {html.escape(note)}</p>" if note else ""
        if self.measured and self.hardware.value == self._measured_hw:
            note = f"<p class='nbtool-measured' style='font-size:smaller'>{html.escape(self.measured)}</p>" + note
        self.ranking.value = f"{note}<ol style='font-size:smaller'>{items}</ol>"
        self.updates += 1

    def _show_chosen(self) -> None:
        line = self.apply_line()
        self.chosen.value = ("" if line is None else "<code class='nbtool-chosen' style='white-space:pre-wrap;"
                             f"font-size:smaller;margin-left:48px'>{html.escape(line)}</code>")

    # -- actions ---------------------------------------------------------------
    def selected(self):
        if self.choice.value is None:
            return None
        return self._runnable[self.choice.value]

    def apply_line(self) -> str | None:
        e = self.selected()
        return None if e is None else f"%%distributed {e.magic_line(self.training())}"

    def apply(self) -> str | None:
        """Put the chosen line into a new cell below; returns how ("inserted", "next-run", None)."""
        line = self.apply_line()
        if line is None:
            self.message.value = "Nothing runnable fits: see the advice above."
            return None
        text = f"{line}\n# your training cell: strategy.prepare(model, optimizer) ..."
        code = f"<code style='user-select:all'>{html.escape(line)}</code>"
        if front_end.has_command("notebook:insert-cell-below"):
            self._app.commands.execute("notebook:insert-cell-below")
            self._app.commands.execute("notebook:replace-selection", {"text": text})
            self.message.value = f"Inserted a new cell below with {code}."
            return "inserted"
        if self.shell is not None:
            self.shell.set_next_input(text, replace=False)
            self.message.value = (f"This front end cannot take a new cell from a widget (no ipylab extension): "
                                  f"{code} will appear in a new cell when the next cell runs; or copy it from here.")
            return "next-run"
        self.message.value = f"Copy this line into a cell: {code}"
        return None

    def export(self) -> str | None:
        from nbtool.spec import deepspeed_config, dumps_config

        e = self.selected()
        if e is None or not e.layout.is_zero:
            self.message.value = "Only ZeRO layouts have a DeepSpeed config; FSDP/DDP options are the magic line."
            return None
        spec = e.spec(self.training())
        text = dumps_config(deepspeed_config(spec, e.dp))
        with open(self.export_path.value, "w") as f:
            f.write(text)
        self.message.value = f"Wrote the DeepSpeed config for {html.escape(_label(e))} to {html.escape(self.export_path.value)}."
        return self.export_path.value

