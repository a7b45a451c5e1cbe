"""Shared fixtures: one real IPython shell and one 2-rank gloo cluster per session."""
from __future__ import annotations

import os
import signal
import sys
import tempfile

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# IPython and ipyparallel profiles of the test session live here, never in the user's ~/.ipython
os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="nbtool-tests-ipython-")
sys.path.insert(0, os.path.dirname(__file__))
# a run started as a background job of a non-interactive shell inherits SIGINT ignored, and then
# _thread.interrupt_main (the tests' Ctrl-C) does nothing: the interrupt tests failed that way only
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    """The session's 2-rank CPU RankCluster (tests that break it restart it in place)."""
    magics = ip.magics_manager.registry["NbtoolMagics"]
    if magics.rank_cluster is None:
        ip.run_line_magic("cluster", "start -n 2")
    yield magics.rank_cluster
    if magics.rank_cluster is not None:
        ip.run_line_magic("cluster", "stop")


@pytest.fixture(scope="module")
def make_cluster(ip, cluster):
    """``make_cluster(n)``: an n-rank cluster that the magics use for this module.

    The session's cluster stays up, parked, and is put back (the module's
    cluster stopped) when the module ends, passed or failed.
    """
    magics = ip.magics_manager.registry["NbtoolMagics"]
    made = []

    def make(n: int):
        magics.rank_cluster = None  # parked: %cluster start makes a new one
        ip.run_line_magic("cluster", f"start -n {n}")
        made.append(magics.rank_cluster)
        return magics.rank_cluster

    yield make
    for rc in made:
        if rc is not None and rc.running:
            rc.stop()
    magics.rank_cluster = cluster


@pytest.fixture(scope="module")
def parked(ip):
    """The module starts and stops its own clusters (other launchers); whatever cluster the session
    had waits, parked, and is put back at the end (a cluster the module left running is stopped)."""
    magics = ip.magics_manager.registry["NbtoolMagics"]
    saved, magics.rank_cluster = magics.rank_cluster, None
    yield
    left = magics.rank_cluster
    if left is not None and left is not saved and left.running:
        left.stop()
    magics.rank_cluster = saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (browser tests screenshot failed checks)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
