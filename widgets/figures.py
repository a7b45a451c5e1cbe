"""Showing plotly figures so they work live in Jupyter and in a saved HTML copy.

Each figure is published with two representations: plotly's own mimetype
(JupyterLab renders it natively) and a self-contained HTML snippet, which
nbconvert's HTML export uses, so an executed notebook saved as HTML shows the
plots offline. plotly.js (~4.6 MB) is inlined once per kernel, in the first
figure shown; later snippets reuse the page's ``window.Plotly``.
"""
from __future__ import annotations

from IPython.display import display

_plotlyjs_sent = False


def figure_bundle(fig) -> dict:
    global _plotlyjs_sent
    html = fig.to_html(full_html=False, include_plotlyjs=not _plotlyjs_sent,
                       config={"displaylogo": False})
    _plotlyjs_sent = True
    return {"application/vnd.plotly.v1+json": fig.to_plotly_json(), "text/html": html}


def show_figure(fig) -> None:
    """Display ``fig`` (a plotly Figure or FigureWidget) as a static, exportable plot."""
    display(figure_bundle(fig), raw=True)
