"""A short soak (benchmarks/soak.py runs the full 200 cells and 10 restarts)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from soak import soak  # noqa: E402

FD_SLACK = 6  # zmq sockets of a fresh client may differ by a few; a leak per cell or restart would not


def test_cells_and_restarts_leak_no_processes_or_fds(ip, cluster):
    r = soak(ip, cells=40, restarts=2)
    assert r["restarts"] == 2
    assert r["processes"][1] == r["processes"][0], r
    assert r["fds"][1] - r["fds"][0] <= FD_SLACK, r
