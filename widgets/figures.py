"""Showing plotly figures so they work live, after reopening, and in every HTML export.

A static figure is published as one output with:

- plotly's own mimetype: JupyterLab and Notebook 7 render it interactively with
  the renderer plotly ships, live and after the notebook is reopened without a
  kernel (no widget model is involved);
- a PNG of the same figure: what ``jupyter nbconvert --to html`` and
  JupyterLab's "Export as HTML" show, with or without "Sanitize HTML output"
  (sanitizing strips scripts, not images), whichever cell ran first. Where a
  JupyterLab-family page shows the output (nbtool.widgets.front_end), plotly's
  renderer draws the figure at the page's width and stores that PNG in the
  output itself, so nbtool adds none (an added PNG would be shown instead of
  the plot, at a fixed width, until the mouse enters it). Headless (nbconvert,
  nbval, the main job) the PNG comes from plotly's kaleido on the system's
  Chromium;
- where neither can make a PNG (no kaleido or no Chromium), an HTML snippet
  carrying plotly.js itself (~4.6 MB per figure, so no figure depends on another
  one's script); a sanitized export then shows no plot.

Live widgets are shown with ``show_live`` under a display id, and
``replace_live`` swaps them in place for the static copy, so a saved notebook
holds no output of a closed widget ("Error displaying widget: model not found").
"""
from __future__ import annotations

import atexit
import base64
import itertools
import threading
import time

from IPython.display import display, update_display

_ids = itertools.count()
_png_state = {"server": False, "broken": None}
_png_lock = threading.Lock()
PNG_WIDTH = 1000


def _png(fig) -> bytes | None:
    """The figure as PNG bytes, or None where kaleido or a Chromium is missing (reason kept once)."""
    if _png_state["broken"]:
        return None
    with _png_lock:
        try:
            import kaleido
            import plotly.io as pio

            if not _png_state["server"]:
                kaleido.start_sync_server(silence_warnings=True)  # one Chromium per kernel: ~0.2 s a figure
                _png_state["server"] = True
                atexit.register(_stop_png_server)
            height = fig.layout.height or 450
            return pio.to_image(fig, format="png", width=PNG_WIDTH, height=height)
        except Exception as e:  # no kaleido, no Chromium, or it failed to start
            _png_state["broken"] = f"{type(e).__name__}: {e}"
            return None


def _stop_png_server() -> None:
    if _png_state["server"]:
        import kaleido

        _png_state["server"] = False
        try:
            kaleido.stop_sync_server(silence_warnings=True)
        except Exception:
            pass


def figure_bundle(fig) -> dict:
    """The output bundle of a static figure (see the module docstring)."""
    import warnings

    import plotly.graph_objects as go

    static = fig if type(fig) is go.Figure else go.Figure(fig)
    bundle = {"application/vnd.plotly.v1+json": static.to_plotly_json(),
              "text/plain": f"<plotly figure: {_title(static)}>"}
    from .front_end import renders_plotly

    if renders_plotly():
        return bundle  # the page's plotly renderer adds its own PNG to this output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kaleido's note that server mode ignores per-call options
        data = _png(static)
    if data is not None:
        bundle["image/png"] = base64.b64encode(data).decode()
    else:
        bundle["text/html"] = static.to_html(full_html=False, include_plotlyjs=True,
                                             config={"displaylogo": False})
    return bundle


def _title(fig) -> str:
    t = fig.layout.title.text if fig.layout.title else None
    return (t or "plot").split("<br>")[0][:120]


def show_figure(fig) -> None:
    """Display ``fig`` (a plotly Figure or FigureWidget) as a static, exportable plot."""
    display(figure_bundle(fig), raw=True)


_retired: list = []  # (time retired, object with close()) of replaced live widgets
RETIRE_S = 5.0
# a FigureWidget's view removed before plotly.js has drawn it fails in the page ("el.on is not a
# function": plotly's widget hooks its events after newPlot resolves); a live plot is kept this long
LIVE_MIN_S = 3.0
_shown: dict = {}  # display id -> time.monotonic() when shown


def show_live(widget) -> str:
    """Display a live widget under a fresh display id (for ``replace_live``)."""
    _close_retired()
    did = f"nbtool-live-{next(_ids)}"
    display(widget, display_id=did)
    _shown[did] = time.monotonic()
    return did


def replace_live(display_id: str, fig=None, retire=None) -> None:
    """Replace the live widget's output in place: by ``fig``'s static copy, or by nothing.

    ``retire`` (the live view, anything with ``close()``) is closed a few
    seconds later, not now: the page may still send a message for a widget
    whose view it is removing, and a comm closed under it shows "Syncing error:
    no comm channel defined" in the browser's console. A retired view's
    FigureWidget is neither closed nor updated (see Dashboard.close).
    """
    from .front_end import renders_plotly

    age = time.monotonic() - _shown.pop(display_id, 0.0)
    if age < LIVE_MIN_S and renders_plotly():  # only a page draws it; headless runs never wait
        time.sleep(LIVE_MIN_S - age)
    if fig is None:
        update_display({"text/plain": ""}, raw=True, display_id=display_id)
    else:
        update_display(figure_bundle(fig), raw=True, display_id=display_id)
    if retire is not None:
        _retired.append((time.monotonic(), retire))


def _close_retired(everything: bool = False) -> None:
    now = time.monotonic()
    keep = []
    for t, w in _retired:
        if everything or now - t >= RETIRE_S:
            try:
                w.close()
            except Exception:
                pass
        else:
            keep.append((t, w))
    _retired[:] = keep


atexit.register(_close_retired, True)
