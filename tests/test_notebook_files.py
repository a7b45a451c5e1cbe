"""The tutorial notebooks as committed: small, and without saved widget state."""
from __future__ import annotations

import json
from pathlib import Path

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_tutorials_are_small_and_hold_no_widget_state():
    assert NOTEBOOKS
    for nb in NOTEBOOKS:
        assert nb.stat().st_size < 200_000, f"{nb.name} is {nb.stat().st_size} bytes (limit 200 KB)"
        meta = json.loads(nb.read_text())["metadata"]
        assert "widgets" not in meta, f"{nb.name} keeps widget state (plotly's JS bundle per figure)"
