"""The planner's figures next to a run's measured ones, as HTML tables for a notebook.

Consumes nbtool.plan.versus's cells only (the text tables show the same ones).
As text, the table's "measured as" column ran past the output area's width
(150-200 characters a row), so each row wrapped into the next and the columns
were lost; here that column wraps within its own cell. A figure outside its
tolerance is marked in colour as well as in words.
"""
from __future__ import annotations

import html

from nbtool.plan.versus import ROUGH, error_cells

OFF = "color:#c62828;font-weight:600"  # outside the stated tolerance
OK = "color:#2e7d32"
LEFT = "text-align:left;vertical-align:top;padding:2px 10px 2px 0"


def _error_style(text: str) -> str:
    text = text.removesuffix(ROUGH)
    if text.endswith(" ok"):
        return OK
    return OFF if text.endswith(" off") or "(>" in text else ""


def _table(cols, rows, css: str, caption: str = "", judged=(), notes: int | None = None, wrap=()) -> str:
    """A left-aligned table; ``judged``: the columns whose cells say ok / off; ``notes``: the column that
    explains each figure (smaller, and wrapped); ``wrap``: other columns of free text that may wrap (run
    names: a pipeline's schedules ran the planner's errors 86 px past the output area); every other cell
    keeps to one line."""
    head = "".join(f"<th style='{LEFT}'>{html.escape(c)}</th>" for c in cols)
    body = []
    for cells in rows:
        tds = []
        for i, c in enumerate(cells):
            style = LEFT
            if i in wrap:
                style += ";min-width:8em"
            elif i == 0:  # a sub-row's indent (its figure starts with spaces): kept as padding
                style += f";padding-left:{(len(c) - len(c.lstrip())) // 2}em;white-space:nowrap"
            elif i == notes:  # what a figure is, explained: smaller, and at least wide enough to read
                style += ";font-size:85%;color:#555;min-width:18em"
            else:
                style += ";white-space:nowrap" + (";" + _error_style(c) if i in judged else "")
            tds.append(f"<td style='{style}'>{html.escape(c.strip())}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    cap = (f"<caption style='text-align:left;caption-side:top;white-space:pre-wrap'>{html.escape(caption)}"
           "</caption>" if caption else "")
    return (f"<table class='{css}' style='margin-left:0;table-layout:auto'>{cap}"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def versus_html(result) -> str:
    """``result`` (a nbtool.plan.versus.Versus) as a table with its heading and notes."""
    head, cols, cells = result.cells()
    return _table(cols, cells, "nbtool-versus", head, judged=(3,), notes=len(cols) - 1) + "".join(
        f"<p style='margin:2px 0'>note: {html.escape(n)}</p>" for n in result.notes)


def error_table_html(results: list) -> str:
    """The planner's error per run (``%dist_compare``): nbtool.plan.versus.error_cells as a table."""
    cols, rows, below = error_cells(results)
    return (_table(cols, rows, "nbtool-errors", judged=range(1, len(cols) - 1), wrap=(0, len(cols) - 1))
            + f"<p style='margin:2px 0;font-size:smaller'>{html.escape(below)}</p>")
