"""The README's main job: execute the quickstart headless, write notebook + HTML, plots visible."""
from __future__ import annotations

import base64
import json
import os
import re
import struct
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
    # the box plot is in the HTML as a PNG (kaleido on the system's Chromium): offline, sanitizer-proof
    pngs = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert len(pngs) == 1
    head = base64.b64decode(pngs[0][:64])
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width == 1000 and height >= 300  # the figure itself, not a placeholder
    # the notebook keeps the interactive copy next to it (plotly's JSON, with the box plot's title)
    figs = [o["data"]["application/vnd.plotly.v1+json"] for c in nb["cells"] for o in c.get("outputs", [])
            if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figs) == 1 and "all_reduce of 1 MiB" in json.dumps(figs[0]["layout"])
