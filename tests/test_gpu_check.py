"""benchmarks/gpu_check.py in its CPU mode: the prepared GPU check cannot rot between GPU slots.

Runs the script as a user would (its own shell and 2-rank gloo cluster) with
``--short``: on this CPU-only machine every check that applies passes, and the
CUDA-only ones are listed as skipped with their reason.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_check_cpu_mode_passes_and_names_what_it_skipped():
    out = subprocess.run([sys.executable, "gpu_check.py", "--short"], cwd=BENCH, capture_output=True, text=True,
                         timeout=420, env=dict(os.environ))
    text = out.stdout
    assert out.returncode == 0, text[-3000:] + out.stderr[-3000:]
    passed, total = map(int, re.search(r"^gpu_check=(\d+)/(\d+)$", text, re.M).groups())
    assert passed == total >= 9, text  # start, 5 strategies, timing, commbench, timeline, watchdog
    assert "SKIP  nccl: no GPU" in text and "SKIP  NVML: no GPU" in text
    for check in ("cluster start", "ddp (fp32,", "zero3 (fp32,", "tp (fp32,", "pp (fp32,", "hang watchdog",
                  "%commbench all_reduce", "collective timing clock", "--memory-timeline"):
        assert re.search(rf"^PASS  {re.escape(check)}", text, re.M), (check, text)
    assert "losses = ddp's" in text and "ledger = expected" in text
