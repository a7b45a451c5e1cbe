"""nbtool's notebook UI in a real browser: JupyterLab in Debian's Chromium, asserting on the page's DOM.

What the user sees is read from the page (plotly's graph divs' ``data``,
cell text, output text), never from Python-side widget state, which looked
right while the browser showed nothing. One JupyterLab server and one browser
for the module; screenshots of failed checks go to ``out/browser/``.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import browser
from browser import Lab, notebook

pytestmark = pytest.mark.slow
ARTIFACTS = Path(__file__).resolve().parents[1] / "out" / "browser"

SETUP = "%load_ext nbtool\n%cluster start -n 2"
DATA = """%%distributed --quiet
import time
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
data = SyntheticTokens(samples=2048, seq=16, vocab=256)"""
# slow enough (~0.25 s a step) that the page can be read several times mid-run
TRAIN = """%%distributed ddp
model = TinyTransformer(vocab=256, dim=64, heads=4, layers=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = strategy.prepare(model, optimizer)
for step, (x, y) in enumerate(strategy.dataloader(data, batch_size=8)):
    loss = lm_loss(model(x), y)
    strategy.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    strategy.log(loss=loss)
    time.sleep(0.25)
    if step == 59:
        break"""
# rank 0 sleeps in Python (an interrupt stops it), rank 1 waits in gloo's all_reduce (native code)
BLOCKED = """%%distributed
import time
if rank == 0:
    time.sleep(120)
dist.all_reduce(torch.ones(1))"""
COMPARE = TRAIN.replace("%%distributed ddp", "%%distributed compare ddp, fsdp --compile").replace("step == 59", "step == 19")
# enough calls per batch that its 5 passes take seconds: the first pass's whole curve shows mid-run
COMMBENCH = "res = %commbench all_reduce --sizes 4B:64KB --factor 4 --iters 1000 --warmup 1"
PLAN = "%load_ext nbtool\n%dist_plan --model llama-2-7b --hardware a100-40gb"
# the CUDA memory panel from recorded GPU figures (a CPU machine has none to measure)
GPU_PANEL = """from nbtool.metrics import CommRecord, MemorySample, RunRecords
from nbtool.widgets import Dashboard, show_figure
run = RunRecords("gpu", "ddp", 2, t_start=0.0)
run.add([MemorySample(r, t, 0, "interval", rss=2**30, cuda_reserved=(t + 1) * 2**30,
                      driver_used=(t + 1) * 2**30 + 3 * 2**29) for r in range(2) for t in range(4)])
# two bucket sizes 2x apart, both between 64 KiB and 1 MiB (powers of 16)
run.add([CommRecord(r, i, "all_reduce", s, s, 2, "float32", 0.1 * i, 1e-3, "cuda_event", 0, busbw=s / 1e-3)
         for r in range(2) for i, s in enumerate((120_000, 240_000))])
dash = Dashboard(2, cuda=True)
dash.refresh(run, force=True)
show_figure(dash.static(run))"""
# the picker on this cluster's CPU ranks, calibrated on the run before it, and the same plan as text
CLUSTER_PLAN = "%dist_plan --model 1e8 --micro-batch 2 --seq 128"
TIMELINE = (TRAIN.replace("%%distributed ddp", "%%distributed ddp --memory-timeline")
            .replace("    time.sleep(0.25)\n", "").replace("step == 59", "step == 4"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    why = browser.missing()
    if why:
        pytest.fail(why)  # a missing browser is a broken set-up, not a reason to skip
    lab = Lab(tmp_path_factory.mktemp("lab"), ARTIFACTS)
    try:
        yield lab
    finally:
        try:
            lab.api("sessions")  # shut every kernel down (their clusters stop with them)
            for s in lab.api("sessions"):
                lab.api(f"sessions/{s['id']}", method="DELETE")
        except Exception:
            pass
        lab.close()


@pytest.fixture
def page(lab, request):
    """The module's Lab; a screenshot of the page when the test fails (conftest keeps the report)."""
    yield lab
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        lab.screenshot(f"failed_{request.node.name}")


def test_live_dashboard_static_copies_interrupt_save_and_export(page):
    lab = page
    lab.write("live.ipynb", notebook(SETUP, DATA, TRAIN, "%cluster status", BLOCKED, "%cluster restart",
                                     COMMBENCH, DATA, COMPARE))
    lab.open("live.ipynb")
    lab.run_and_wait(0, 120)
    assert "ready: 2 rank(s), backend gloo" in lab.output_text(0)
    lab.run_and_wait(1, 60)

    # the live dashboard gains points while the ranks train: read the page's plots mid-run
    lab.run(2)
    lab.wait(lambda: lab.plots(2), 60, "the live dashboard did not appear")
    counts = []
    for _ in range(3):
        time.sleep(2.5)
        if lab.busy():
            counts.append(sum(lab.plots(2)[0]))
    assert len(counts) >= 2 and counts[-1] > counts[0] > 0, counts
    lab.shot_output(2, "dashboard_live")
    lab.wait_idle(120)
    lab.shot_output(2, "dashboard_static")

    # when the cell ends the widget's output is replaced in place by a static copy (no widget left)
    assert lab.js("return document.querySelectorAll('.jp-Cell')[2]"
                  ".querySelectorAll('.jupyter-widgets, .widget-dropdown').length") == 0
    final = lab.plots(2)
    assert len(final) == 1 and sum(final[0]) >= counts[-1]
    title = lab.js("return document.querySelectorAll('.jp-Cell')[2].querySelector('.gtitle').textContent")
    assert "ddp:" in title and "optimizer steps" in title
    # the bus-bandwidth panel names sizes on its axis, from one at or below the smallest collective to one
    # at or above the largest (where they lay within 16x of each other, between two fixed powers of 16,
    # the axis had named none)
    _sizes_named_around_the_data(lab, 2)
    assert lab.js("return document.querySelectorAll('.jp-Cell')[2].querySelector('.js-plotly-plot')"
                  ".layout.annotations[2].text") == "loss (strategy.log)"  # it logged its loss
    # under the run, the planner's figures next to the measured ones (model states exact in fp32), as a
    # table whose columns hold within the output's width (as text its rows ran past it and wrapped)
    out = lab.output_text(2)
    assert "predicted vs measured, run 'ddp'" in out, out
    rows = {r[0]: r for r in _table(lab, 2, "nbtool-versus")}
    assert rows["figure"] == ["figure", "measured", "predicted", "error", "measured as"], rows
    assert rows["model states"][3] == "+0.0% ok" and rows["model states"][4].startswith("ledger"), rows
    assert all(f in rows for f in ("peak tensor memory", "step time", "exposed comm", "throughput")), rows
    assert re.fullmatch(r"[0-9.]+ ms", rows["step time"][1]) and re.fullmatch(r"[0-9.]+ ms", rows["step time"][2])
    assert _fits(lab, 2, "nbtool-versus")
    lab.shot_element(2, "table.nbtool-versus", "predicted_vs_measured")

    # %cluster status: a table whose caption is left-aligned
    lab.run_and_wait(3, 30)
    align = lab.js("const c = document.querySelectorAll('.jp-Cell')[3].querySelector('caption');"
                   "return c ? getComputedStyle(c).textAlign : null")
    assert align == "left"

    # interrupt from the toolbar with rank 0 sleeping and rank 1 blocked in an all_reduce
    lab.run(4)
    lab.wait(lambda: lab.busy(), 10, "the blocked cell did not start")
    time.sleep(3)
    t0 = time.monotonic()
    lab.driver.find_element("css selector", "jp-button[data-command='notebook:interrupt-kernel'], "
                            "button[data-command='notebook:interrupt-kernel']").click()
    lab.wait_idle(30)
    took = time.monotonic() - t0
    out = lab.output_text(4)
    assert "rank 1 was released by closing the process group on rank 0" in out, out
    assert "restarted" not in out and took < 10, (took, out)
    lab.run_and_wait(5, 120)

    # %commbench: a live plot whose first pass draws every size while later passes run, then its static
    # figure in place
    lab.run(6)
    title = "return Array.from(document.querySelectorAll('.jp-Cell')[6].querySelectorAll('.gtitle, .annotation-text'))" \
            ".map(e => e.textContent).join(' | ')"
    lab.wait(lambda: lab.busy() and lab.plots(6) and all(n == 8 for n in lab.plots(6)[0])
             and re.search(r"live, pass [1-4] of 5", lab.js(title)), 60,
             "the live %commbench plot did not show every size before its last pass")
    lab.wait_idle(120)
    assert lab.js("return document.querySelectorAll('.jp-Cell')[6].querySelectorAll('.jupyter-widgets').length") == 0
    lab.shot_output(6, "commbench")
    bench = lab.plots(6)
    assert len(bench) == 1 and bench[0] and all(n == 8 for n in bench[0]), bench  # 4 B to 64 KiB by 4: 8 sizes

    # %%distributed compare: a live dashboard while each run trains, then static copies and the comparison
    lab.run_and_wait(7, 30)
    lab.run(8)
    lab.wait(lambda: lab.js("return document.querySelectorAll('.jp-Cell')[8].querySelectorAll('.jupyter-widgets')"
                            ".length") > 0 and lab.plots(8), 60, "compare showed no live dashboard")
    lab.wait_idle(180)
    assert len(lab.plots(8)) == 3  # each run's static copy, then the comparison's figure
    assert "fsdp" in lab.output_text(8) and "vs first" in lab.output_text(8)
    assert "compile s" in lab.output_text(8)  # torch.compile's seconds, apart from the step times
    assert "planner's error (predicted - measured) / measured" in lab.output_text(8)
    errors = {r[0]: r for r in _table(lab, 8, "nbtool-errors")}  # a row per run: ddp's, then fsdp's
    assert [r[1] for r in errors.values()][1:] == ["+0.0% ok", "+0.0% ok"], errors
    assert _fits(lab, 8, "nbtool-errors") and _fits(lab, 8, "nbtool-compare")  # every column in sight
    lab.shot_element(8, "table.nbtool-errors", "planner_errors")
    lab.shot_element(8, "table.nbtool-compare", "comparison")

    errors = [e for e in lab.console_errors() if "favicon" not in e]
    assert not errors, errors

    # save, reopen: no dead widget, every static figure renders from the saved file alone
    def saved_mimes() -> list:
        lab.save("live.ipynb")
        return [m for c in lab.saved("live.ipynb")["cells"] for o in c.get("outputs", []) for m in o.get("data", {})]

    # five figures, each with the PNG the page's plotly renderer stores next to it once it has drawn it
    # (seconds later on a loaded machine): saved again, one save at a time, until the file holds all
    # five (a PNG stored while a save is in flight leaves the page clean yet unwritten), at most 6 times
    mimes = saved_mimes()
    for _ in range(5):
        if mimes.count("image/png") >= 5:
            break
        time.sleep(3)
        mimes = saved_mimes()
    assert "application/vnd.jupyter.widget-view+json" not in mimes
    assert mimes.count("image/png") == mimes.count("application/vnd.plotly.v1+json") == 5, mimes
    for s in lab.api("sessions"):  # reopen without a kernel that knows any widget
        lab.api(f"sessions/{s['id']}", method="DELETE")
    lab.driver.refresh()
    # plotly's renderer shows the stored PNG, and the interactive plot once the mouse enters it
    shown = ("return Array.from(document.querySelectorAll('.jp-RenderedPlotly img.plot-img'))"
             ".filter(i => i.complete && i.naturalWidth > 400 && i.offsetParent).length")
    lab.wait(lambda: lab.js(shown) == 5, 60, "static figures did not render after reopening")
    page = lab.js("return document.querySelector('.jp-Notebook').innerText")
    assert "Error displaying widget" not in page
    from selenium.webdriver.common.action_chains import ActionChains

    img = lab.driver.find_elements("css selector", ".jp-RenderedPlotly img.plot-img")[0]
    lab.js("arguments[0].scrollIntoView({block: 'center'})", img)
    ActionChains(lab.driver).move_to_element(img).perform()
    lab.wait(lambda: lab.plots() and sum(lab.plots()[0]) > 0, 20, "the reopened figure did not become interactive")

    # HTML exports, plain and sanitized (JupyterLab's default export), opened in the browser
    for sanitize in (False, True):
        html = _export(lab.root / "live.ipynb", sanitize)
        lab.driver.get(html.as_uri())
        imgs = lab.js("return Array.from(document.querySelectorAll('img'))"
                      ".filter(i => i.complete && i.naturalWidth > 400).length")
        assert imgs == 5, (sanitize, imgs)
        text = lab.js("return document.body.innerText")
        assert "VBox(" not in text and "Plotly is not defined" not in text and "!function" not in text
    lab.console_errors()  # drop the exported pages' messages (nbconvert's template names CDN scripts)


def _table(lab, cell: int, css: str) -> list[list[str]]:
    """The text of each cell of each row of the table of class ``css`` in cell ``cell``'s output."""
    return lab.js("return Array.from(document.querySelectorAll('.jp-Cell')[arguments[0]]"
                  ".querySelectorAll('table.' + arguments[1] + ' tr'))"
                  ".map(r => Array.from(r.cells).map(c => c.innerText.trim()))", cell, css)


def _fits(lab, cell: int, css: str) -> bool:
    """The table of class ``css`` fits its output area's width (no horizontal scrollbar)."""
    return lab.js("const t = document.querySelectorAll('.jp-Cell')[arguments[0]]"
                  ".querySelector('table.' + arguments[1]);"
                  "const o = t.closest('.jp-OutputArea-output');"
                  "return t.getBoundingClientRect().width <= o.clientWidth + 1 && o.scrollWidth <= o.clientWidth + 1",
                  cell, css)


def _sizes_named_around_the_data(lab, cell: int) -> None:
    """The dashboard's bus-bandwidth panel (x5) names a size at or below its smallest collective and one at
    or above its largest."""
    ticks, xs = lab.js("const c = document.querySelectorAll('.jp-Cell')[arguments[0]];"
                       "return [Array.from(c.querySelectorAll('g.x5tick text')).map(t => t.textContent),"
                       "c.querySelector('.js-plotly-plot').data.filter(t => t.xaxis === 'x5').flatMap(t => t.x)]",
                       cell)
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    named = [int(t.split()[0]) * unit[t.split()[1]] for t in ticks]
    assert xs and len(named) >= 2 and named[0] <= min(xs) and named[-1] >= max(xs), (ticks, min(xs), max(xs))


def _controls_outside(lab, cell: int) -> list[str]:
    """The widget rows with a horizontal scrollbar, and the controls reaching past the right edge of the
    output area, in cell ``cell``'s output (a row's own scrollbar hides them from the output's check)."""
    return lab.js("""
        const o = document.querySelectorAll('.jp-Cell')[arguments[0]].querySelector('.jp-OutputArea-output');
        const right = o.getBoundingClientRect().right;
        const rows = Array.from(o.querySelectorAll('.widget-box')).filter(b => b.scrollWidth > b.clientWidth + 1)
            .map(b => 'row scrolls: ' + b.innerText.slice(0, 40));
        const controls = Array.from(o.querySelectorAll('button.widget-button, select, input, .widget-label'))
            .filter(e => e.offsetParent && e.getBoundingClientRect().right > right + 1)
            .map(e => 'past the edge: ' + (e.innerText || e.tagName).slice(0, 40));
        return rows.concat(controls);""", cell)


def _export(path: Path, sanitize: bool) -> Path:
    out = path.with_name(f"{path.stem}-{'sanitized' if sanitize else 'plain'}.html")
    cmd = [sys.executable, "-m", "nbconvert", "--to", "html", str(path), "--output", out.stem,
           "--output-dir", str(path.parent)]
    if sanitize:
        cmd.append("--HTMLExporter.sanitize_html=True")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return out


def test_memory_timeline_plot_shows_each_ranks_categories(page):
    """--memory-timeline: under the dashboard's static copy, a stacked plot per rank whose traces are
    torch.profiler's categories, with points, read from the page. Then, on the same cluster, the
    picker's note where the CPU ranks emulate bf16."""
    lab = page
    lab.write("timeline.ipynb", notebook(SETUP, DATA, TIMELINE, GPU_PANEL, CLUSTER_PLAN,
                                         CLUSTER_PLAN.replace("%dist_plan", "%dist_plan --text"), "%dist_plan"))
    lab.open("timeline.ipynb")
    lab.run_and_wait(0, 120)
    lab.run_and_wait(1, 60)
    lab.run_and_wait(2, 180)
    assert "memory timeline (tracked tensor bytes by category" in lab.output_text(2)
    lab.wait(lambda: len(lab.plots(2)) == 2, 30, "the memory timeline plot did not appear")
    traces = lab.js("""
        const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[2].querySelectorAll('.js-plotly-plot')[1];
        return (p.data || []).map(t => [t.name, t.xaxis || 'x', (t.y || []).length, Math.max(...(t.y || [0]))]);""")
    by_axis = {}
    for name, axis, n, top in traces:
        by_axis.setdefault(axis, {})[name] = (n, top)
    assert sorted(by_axis) == ["x", "x2"], traces  # rank 0 and rank 1 side by side
    for cats in by_axis.values():
        # torch's categories, or (when its analysis asserts, which it sometimes does on DDP) the
        # uncategorised bytes the cell allocated, with the reason printed
        assert {"parameter", "optimizer_state", "activation"} <= set(cats) or (
            set(cats) == {"uncategorised"} and "could not categorise" in lab.output_text(2)), traces
        assert all(n > 1 and top > 0 for n, top in cats.values()), traces
    lab.shot_output(2, "memory_timeline")

    # CUDA ranks' memory panel: reserved and driver lines 1.5 GiB apart, the gap named in the title
    lab.run_and_wait(3, 60)
    lab.wait(lambda: lab.plots(3), 30, "the GPU dashboard copy did not appear")
    lines = lab.js("""
        const p = document.querySelectorAll('.jp-Notebook .jp-Cell')[3].querySelector('.js-plotly-plot');
        const pick = n => Array.from(p.data.find(t => t.name === n).y);
        return [pick('rank 0 reserved'), pick('rank 0 driver (NVML)'),
                p.querySelector('.gtitle').textContent, p.layout.annotations[1].text, p.layout.annotations[2].text];""")
    reserved, driver, title, panel, loss = lines
    assert loss == "loss (strategy.log): none logged", lines  # no strategy.log(loss=...): the empty panel says so
    assert reserved == [1024, 2048, 3072, 4096] and [d - r for d, r in zip(driver, reserved)] == [1536] * 4, lines
    assert "outside PyTorch's allocator (driver minus reserved): rank 0 1.50 GiB" in title and panel.startswith("GPU")
    # its two bucket sizes lie between two powers of 16: the axis names the sizes around them
    _sizes_named_around_the_data(lab, 3)

    # the picker on CPU ranks that emulate bf16 says so above its ranking, as %dist_plan --text does;
    # at fp32 the note goes
    lab.run_and_wait(4, 60)
    lab.wait(lambda: lab.plots(4) and sum(lab.plots(4)[0]) > 0, 20, "the cluster's picker chart has no bars")
    lab.run_and_wait(5, 60)
    text_note = [line for line in lab.output_text(5).splitlines() if line.startswith("note: bf16 computes at")]
    page_note = lambda: lab.js("const n = document.querySelectorAll('.jp-Cell')[4].querySelector('.nbtool-note');"
                               "return n ? n.innerText : null")
    if text_note:
        assert page_note() == text_note[0], (page_note(), text_note)
        lab.shot_output(4, "picker_cpu_ranks")
        lab.set_select(4, "precision", "fp32")
        lab.wait(lambda: page_note() is None, 10, "the bf16 note stayed after precision went to fp32")
    else:
        assert page_note() is None, page_note()
    # which figures were measured, and on which run: the same line as the text's, on the page while this
    # cluster's hardware is selected, gone with a preset's
    measured = [line for line in lab.output_text(5).splitlines() if line.startswith("measured on this cluster: ")]
    page_measured = lambda: lab.js("const n = document.querySelectorAll('.jp-Cell')[4]"
                                   ".querySelector('.nbtool-measured'); return n ? n.innerText : null")
    assert measured and "from run 'ddp'" in measured[0] and page_measured() == measured[0], (measured, page_measured())
    lab.set_select(4, "hardware", "8x A100-40GB NVLink")
    lab.wait(lambda: page_measured() is None, 10, "the measured line stayed with a preset's hardware")
    # no --model: the picker offers the model the last run trained, and charts it
    lab.run_and_wait(6, 60)
    lab.wait(lambda: lab.plots(6) and sum(lab.plots(6)[0]) > 0, 20, "the last run's model got no bars")
    assert lab.selected(6, "model") == "the model of run 'ddp'", lab.selected(6, "model")
    assert "planning the model run 'ddp' trained" in lab.output_text(6), lab.output_text(6)
    errors = [e for e in lab.console_errors() if "favicon" not in e]
    assert not errors, errors
    for s in lab.api("sessions"):  # its cluster goes with its kernel
        lab.api(f"sessions/{s['id']}", method="DELETE")


def test_picker_chart_follows_inputs_and_apply_writes_the_cell(page):
    lab = page
    lab.write("plan.ipynb", notebook(PLAN, "1 + 1"))
    lab.open("plan.ipynb")
    lab.run_and_wait(0, 60)
    lab.wait(lambda: lab.plots(0) and sum(lab.plots(0)[0]) > 0, 20, "the picker chart has no bars")
    bars = lab.plot_y(0)
    assert len(bars[0]) >= 8  # one bar per layout, each category stacked
    assert all(y > 0 for y in bars[5])  # cuBLAS's workspaces on every GPU (the sixth category)
    # every bar of both charts is named under it (plotly drops names that would overlap)
    names = lab.js("const c = document.querySelectorAll('.jp-Cell')[0];"
                   "return [c.querySelectorAll('g.xtick text').length, c.querySelectorAll('g.x2tick text').length]")
    assert names == [len(bars[0])] * 2, names

    lab.shot_output(0, "picker")
    # change an input in the page: the chart follows
    lab.set_select(0, "checkpointing", "full")
    lab.wait(lambda: lab.plot_y(0) != bars, 10, "the chart did not change after an input changed")

    # the inputs are not clipped: no horizontal scrollbar in the output or in any row of it, every control
    # (Apply too, whose row holds the longest line of all) inside the output area, labels whole
    assert lab.js("const o = document.querySelectorAll('.jp-Cell')[0].querySelector('.jp-OutputArea-output');"
                  "return o.scrollWidth <= o.clientWidth + 1")
    assert _controls_outside(lab, 0) == []
    labels = lab.js("return Array.from(document.querySelectorAll('.jp-Cell')[0]"
                    ".querySelectorAll('.widget-label')).filter(l => l.offsetParent)"
                    ".map(l => l.scrollWidth <= l.clientWidth + 1)")
    assert labels and all(labels)
    assert "params (B)" not in lab.output_text(0)  # only shown for a custom model

    # the chosen line is shown whole under the dropdown (which cuts it at its width), and follows a choice
    shown = "const c = document.querySelectorAll('.jp-Cell')[0].querySelector('.nbtool-chosen');" \
            "return c ? c.innerText : null"
    options = lab.js("return Array.from(arguments[0].options).map(o => o.text.replace(/\u00a0/g, ' '))",
                     lab._dropdown(0, "run"))
    assert len(options) >= 2, options
    lab.set_select(0, "run", options[1])
    lab.wait(lambda: lab.js(shown) == options[1][options[1].index("%%distributed"):], 10,
             "the chosen line under the dropdown did not follow the choice")

    # Apply: a new cell right below the picker holds exactly the chosen line, within 2 s
    n = len(lab.cells())
    chosen = lab.selected(0, "run")
    line = chosen[chosen.index("%%distributed"):]
    assert lab.js(shown) == line
    button = lab.js("return Array.from(document.querySelectorAll('.jp-Cell')[0].querySelectorAll('button'))"
                    ".find(b => b.innerText.startsWith('Apply'))")
    t0 = time.monotonic()
    button.click()  # a real click: it makes the picker's cell the active one, as for a user
    lab.wait(lambda: len(lab.cells()) == n + 1, 2.0, "Apply did not insert a cell within 2 s")
    assert time.monotonic() - t0 <= 2.0
    assert lab.cell_text(1).splitlines()[0] == line
    assert "Inserted a new cell below" in lab.output_text(0)
    errors = [e for e in lab.console_errors() if "favicon" not in e]
    assert not errors, errors




def test_apply_writes_the_cell_in_notebook_7(page):
    """The same picker and Apply in Notebook 7's page (ipylab's extension runs there too)."""
    lab = page
    lab.write("plan7.ipynb", notebook(PLAN, "1 + 1"))
    lab.open_notebook7("plan7.ipynb")
    # Notebook 7.6 itself logs "Cannot read properties of undefined (reading 'schema')" on opening any
    # notebook, before any output: only what appears after that counts
    before = set(lab.console_errors())
    lab.run_and_wait(0, 60)
    lab.wait(lambda: lab.plots(0) and sum(lab.plots(0)[0]) > 0, 20, "the picker chart has no bars (Notebook 7)")
    assert _controls_outside(lab, 0) == []
    n = len(lab.cells())
    chosen = lab.selected(0, "run")
    button = lab.js("return Array.from(document.querySelectorAll('.jp-Cell')[0].querySelectorAll('button'))"
                    ".find(b => b.innerText.startsWith('Apply'))")
    button.click()
    lab.wait(lambda: len(lab.cells()) == n + 1, 2.0, "Apply did not insert a cell within 2 s (Notebook 7)")
    assert lab.cell_text(1).splitlines()[0] == chosen[chosen.index("%%distributed"):]
    errors = [e for e in lab.console_errors() if "favicon" not in e and e not in before]
    assert not errors, errors
