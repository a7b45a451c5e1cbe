"""The cluster's status table and the progress line shown while it starts."""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from IPython.display import display, update_display

from nbtool.metrics import format_bytes

COLUMNS = ("rank", "engine", "pid", "host", "node", "local rank", "device", "backend", "rss", "state")


def _mib(n) -> str:
    return format_bytes(n) if isinstance(n, (int, float)) else "-"


@dataclass
class StatusTable:
    """``%cluster status`` rows: one per rank, from ``RankCluster.status()``.

    RSS is the engine process's resident set size (OS figure, includes
    torch's libraries and allocator caches), not tensor bytes.
    """

    rows: list[dict]
    header: str = ""

    def cells(self) -> list[tuple[str, ...]]:
        return [
            (
                str(r.get("rank", "-")),
                str(r.get("engine_id", "-")),
                str(r.get("pid", "-")),
                str(r.get("host", "-")),
                str(r.get("node_rank", "-")),
                str(r.get("local_rank", "-")),
                str(r.get("device", "-")),
                str(r.get("backend") or "-"),
                _mib(r.get("rss_bytes")),
                str(r.get("state", "-")),
            )
            for r in self.rows
        ]

    def __repr__(self) -> str:
        body = [COLUMNS, *self.cells()]
        widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
        return "\n".join(([self.header] if self.header else []) + lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.cells()
        )
        # left-aligned, line breaks kept: browsers centre a caption and wrap it to the table's width
        caption = (f"<caption style='text-align:left; white-space:pre-wrap; caption-side:top'>"
                   f"{html.escape(self.header)}</caption>" if self.header else "")
        return f"<table class='nbtool-status'>{caption}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


@dataclass
class ProgressLine:
    """One line of progress, updated in place in a notebook, printed in a terminal."""

    in_kernel: bool
    _id: str | None = None
    _t0: float = field(default_factory=time.perf_counter)

    def __call__(self, message: str) -> None:
        text = f"nbtool: {message}"
        if not self.in_kernel:
            print(text, flush=True)
        elif self._id is None:
            self._id = f"nbtool-progress-{id(self)}-{self._t0}"
            display({"text/plain": text}, raw=True, display_id=self._id)
        else:
            update_display({"text/plain": text}, raw=True, display_id=self._id)
