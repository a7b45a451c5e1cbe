"""Showing what ranks print: live while a cell runs, grouped by rank at the end.

In a Jupyter kernel one display is updated in place (throttled), then blanked
and replaced by the final text as an ordinary stream, so an executed notebook
(and nbval, which ignores display updates) holds exactly the final text.
Outside a kernel (terminal IPython, tests) new text is printed as it arrives,
each line prefixed with its rank.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field

from IPython.display import display, update_display

from nbtool.options import format_ranks

_CR = re.compile(r"[^\n]*\r(?!\n)")  # text a carriage return overwrites (tqdm)


def settle_carriage_returns(text: str) -> str:
    """What a terminal would show: each '\\r' erases the line so far."""
    return _CR.sub("", text)


@dataclass
class RankText:
    rank: int
    stdout: str = ""
    stderr: str = ""
    result: str = ""  # text/plain of the cell's last expression, if any

    def block(self) -> str:
        body = settle_carriage_returns(self.stdout)
        if self.stderr:
            if body and not body.endswith("\n"):
                body += "\n"
            body += settle_carriage_returns(self.stderr)
        if self.result:
            if body and not body.endswith("\n"):
                body += "\n"
            body += f"Out: {self.result}"
        return body


def snapshot(rank: int, metadata) -> RankText:
    res = metadata.get("execute_result") or {}
    return RankText(
        rank,
        metadata.get("stdout") or "",
        metadata.get("stderr") or "",
        (res.get("data") or {}).get("text/plain", ""),
    )


def grouped(texts: list[RankText]) -> str:
    """Rank blocks in rank order; ranks that printed the same text share one block."""
    groups: dict[str, list[int]] = {}
    for t in sorted(texts, key=lambda t: t.rank):
        body = t.block()
        if body:
            groups.setdefault(body, []).append(t.rank)
    out = []
    for body, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        label = "rank" if len(ranks) == 1 else "ranks"
        out.append(f"[{label} {format_ranks(ranks)}]\n{body.rstrip(chr(10))}\n")
    return "".join(out)


@dataclass
class RankOutputView:
    """Live view of the ranks' output for one cell."""

    in_kernel: bool
    enabled: bool = True
    refresh_s: float = 0.25
    _display_id: str | None = None
    _last: float = 0.0
    _shown: str = ""
    _printed: dict = field(default_factory=dict)  # (rank, stream) -> chars printed

    def start(self) -> None:
        """Put the (blank) live display under the cell now, whether or not output comes.

        Every cell then has the same output structure however long it runs,
        which keeps executed notebooks (and nbval's comparisons) deterministic.
        """
        if self.in_kernel and self.enabled and self._display_id is None:
            self._display_id = f"nbtool-{id(self)}-{time.monotonic()}"
            display({"text/plain": ""}, raw=True, display_id=self._display_id)

    def update(self, texts: list[RankText], force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.refresh_s:
            return
        self._last = now
        if self.in_kernel:
            text = grouped(texts)
            if text == self._shown:
                return
            self.start()  # blank first: nbval records the first version of a display only
            update_display({"text/plain": text}, raw=True, display_id=self._display_id)
            self._shown = text
        else:
            self._print_new(texts)

    def _print_new(self, texts: list[RankText]) -> None:
        for t in sorted(texts, key=lambda t: t.rank):
            for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                full = getattr(t, name)
                done = self._printed.get((t.rank, name), 0)
                # print whole lines only, so prefixes stay at line starts
                end = full.rfind("\n") + 1
                if end > done:
                    for line in settle_carriage_returns(full[done:end]).splitlines():
                        print(f"[rank {t.rank}] {line}", file=stream)
                    self._printed[(t.rank, name)] = end
        sys.stdout.flush()

    def finish(self, texts: list[RankText]) -> None:
        """Show the final, rank-ordered output (once)."""
        if not self.enabled:
            return
        if self.in_kernel:
            if self._display_id is not None:
                update_display({"text/plain": ""}, raw=True, display_id=self._display_id)
            text = grouped(texts)
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
            return
        self._print_new(texts)
        for t in sorted(texts, key=lambda t: t.rank):
            for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                full = getattr(t, name)
                rest = full[self._printed.get((t.rank, name), 0):]
                if rest:
                    print(f"[rank {t.rank}] {settle_carriage_returns(rest)}", file=stream)
            if t.result:
                print(f"[rank {t.rank}] Out: {t.result}")
        sys.stdout.flush()
