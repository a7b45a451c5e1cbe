"""Shared fixtures: one real IPython shell and one 2-rank gloo cluster per session."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def ip():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "nbtool")
    yield shell
    magics = shell.magics_manager.registry["NbtoolMagics"]
    if magics.rank_cluster is not None:
        magics.rank_cluster.stop()
        magics.rank_cluster = None


@pytest.fixture(scope="session")
def cluster(ip):
    """The session's 2-rank CPU cluster (restarted by tests that break it)."""
    magics = ip.magics_manager.registry["NbtoolMagics"]
    if magics.rank_cluster is None:
        ip.run_line_magic("cluster", "start -n 2")
    yield magics
    if magics.rank_cluster is not None:
        ip.run_line_magic("cluster", "stop")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (browser tests screenshot failed checks)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
