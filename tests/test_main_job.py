"""The README's main job: execute the quickstart headless, write notebook + HTML, plots visible."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import browser_dom

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_quickstart_job_writes_notebook_and_html_with_plots(tmp_path):
    env = dict(os.environ, NBTOOL_SKIP_SETUP="1", NBTOOL_OUT=str(tmp_path))
    proc = subprocess.run(["bash", ".ci/quickstart"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"HTML copy:          {tmp_path}/01_quickstart.html" in proc.stdout
    assert "jupyter lab notebooks/01_quickstart.ipynb" in proc.stdout

    nb = json.loads((tmp_path / "01_quickstart.executed.ipynb").read_text())
    texts = ["".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", [])]
    assert "[ranks 0-1]\nall_reduce sum = 3 on 2 ranks\n" in texts
    # no ipyparallel log chatter in the notebook
    assert not any("IPEngine" in t or "engine set stopped" in t for t in texts)

    dom = browser_dom(tmp_path / "01_quickstart.html")
    assert dom.count('class="plot-container plotly"') == 1  # the box plot rendered offline
    assert "all_reduce of 1 MiB" in dom
