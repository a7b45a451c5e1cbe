"""Ranks on a real Slurm (tests/slurm_site.py): ipyparallel's Slurm launcher submits the engines' job.

Skipped, with the reason, only where slurm-wlm and munge are not installed
or the tests do not run as root (.ci/setup installs them on CI).
"""
from __future__ import annotations

import subprocess
import threading
import time

import psutil
import pytest

from nbtool.cluster import ClusterError
from helpers import orphan_controllers, site
from slurm_site import SlurmSite, unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, parked):
    yield from site(SlurmSite, unavailable, "no Slurm on this machine", tmp_path_factory.mktemp("slurm"))


def _cluster(ip):
    return ip.magics_manager.registry["NbtoolMagics"].rank_cluster


def _gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_slurm_cluster_is_one_world_in_slurms_order_and_stop_leaves_nothing(ip, slurm):
    ip.run_line_magic("cluster", "start -n 2 --engines slurm --timeout 90")
    cluster = _cluster(ip)
    try:
        job = cluster.slurm_job
        assert job and slurm.jobs() == [f"{job} RUNNING"]
        assert f"launcher slurm, job {job}" in repr(ip.run_line_magic("cluster", "status"))
        ip.run_cell("%%distributed --quiet\nimport os\n_ids = (int(os.environ['SLURM_PROCID']), rank, "
                    "os.environ['SLURM_JOB_ID'], os.environ['LOCAL_RANK'], os.environ['NODE_RANK'])\n"
                    "_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)").raise_error()
        ip.run_line_magic("dist_pull", "_ids _t")
        assert ip.user_ns["_ids"] == [(0, 0, job, "0", "0"), (1, 1, job, "1", "0")]  # rank = Slurm's task id
        assert [t.item() for t in ip.user_ns["_t"]] == [3.0, 3.0]
        ip.run_cell("%%distributed fsdp --quiet\nfrom nbtool.rank.example_models import TinyTransformer, "
                    "SyntheticTokens, lm_loss\nm = TinyTransformer()\no = torch.optim.AdamW(m.parameters())\n"
                    "m, o = strategy.prepare(m, o)\nfor i, (x, y) in enumerate(strategy.dataloader(SyntheticTokens(32), 4)):\n"
                    "    strategy.backward(lm_loss(m(x), y)); o.step(); o.zero_grad()\n    if i == 2:\n        break\n"
                    "_steps = strategy.steps").raise_error()
        ip.run_line_magic("dist_pull", "_steps")
        assert ip.user_ns["_steps"] == [3, 3]
        pids = list(cluster.pids)
    finally:
        ip.run_line_magic("cluster", "stop")
    assert slurm.jobs() == []  # scancel'd, and gone from the queue when stop returns
    assert _gone(pids)


def test_scancel_mid_cell_is_named_with_the_jobs_state(ip, slurm):
    ip.run_line_magic("cluster", "start -n 2 --engines slurm --timeout 90")
    cluster = _cluster(ip)
    try:
        job = cluster.slurm_job
        threading.Timer(3.0, lambda: subprocess.run(["scancel", job], timeout=10)).start()
        t0 = time.perf_counter()
        res = ip.run_cell("%%distributed --quiet\nimport time\nfor _ in range(3000):\n"
                          "    dist.all_reduce(torch.ones(1)); time.sleep(0.01)")
        took = time.perf_counter() - t0 - 3.0
        text = "\n".join(res.error_in_exec._render_traceback_())
        assert f"slurm job {job} CANCELLED" in text, text
        assert "gone; %cluster restart brings back 2 rank(s)" in text, text
        assert took < 30, took
        assert [r["state"] for r in cluster.status()] == ["lost", "lost"]
    finally:
        ip.run_line_magic("cluster", "stop")
    assert slurm.jobs() == []


def test_a_job_preempted_mid_cell_is_named_with_the_jobs_state(ip, slurm):
    """A job of the higher-tier partition takes the whole node: Slurm cancels the engines' job for it."""
    ip.run_line_magic("cluster", "start -n 2 --engines slurm --timeout 90")
    cluster = _cluster(ip)
    urgent = None
    try:
        job = cluster.slurm_job

        def preempt():
            nonlocal urgent
            out = subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--exclusive", "--ntasks=2",
                                  "--output=/dev/null", "--wrap=sleep 300"], capture_output=True, text=True, timeout=10)
            urgent = out.stdout.strip().split(";")[0] or out.stderr

        threading.Timer(3.0, preempt).start()
        t0 = time.perf_counter()
        res = ip.run_cell("%%distributed --quiet\nimport time\nfor _ in range(3000):\n"
                          "    dist.all_reduce(torch.ones(1)); time.sleep(0.01)")
        took = time.perf_counter() - t0 - 3.0
        text = "\n".join(res.error_in_exec._render_traceback_())
        assert f"slurm job {job} PREEMPTED" in text, (text, urgent)
        assert took < 30, took
        assert [r["state"] for r in cluster.status()] == ["lost", "lost"]
    finally:
        ip.run_line_magic("cluster", "stop")
        if urgent and urgent.isdigit():
            subprocess.run(["scancel", urgent], timeout=10)
            deadline = time.monotonic() + 30
            while slurm.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
    assert slurm.jobs() == []


def test_a_job_that_never_starts_is_refused_within_timeout_with_slurms_reason(ip, slurm):
    t0 = time.perf_counter()
    with pytest.raises(ClusterError) as info:  # held back an hour: pending (BeginTime) until --timeout
        ip.run_line_magic("cluster", 'start -n 2 --engines slurm --timeout 8 --slurm-args "--begin=now+3600 '
                                     '--job-name=held"')
    assert time.perf_counter() - t0 < 8 + 30
    assert "within --timeout 8s" in str(info.value) and "pending (BeginTime)" in str(info.value), info.value
    assert slurm.jobs() == []  # nothing left queued
    assert _cluster(ip) is None


def test_a_request_slurm_never_grants_is_refused_at_once_with_its_reason(ip, slurm):
    t0 = time.perf_counter()
    with pytest.raises(ClusterError) as info:  # one node here: three are never had
        ip.run_line_magic("cluster", 'start -n 2 --engines slurm --timeout 60 --slurm-args "--nodes=3 --exclusive"')
    assert time.perf_counter() - t0 < 30  # not the whole --timeout
    assert "cannot start: pending (Partition" in str(info.value), info.value  # PartitionConfig or ...NodeLimit
    assert slurm.jobs() == []


def test_a_job_sbatch_refuses_is_refused_with_sbatchs_words(ip, slurm):
    # refused a few times: the controller's schedulers were orphaned in about 1 start of 5, when
    # sbatch's refusal stopped the controller while it was forking them
    for _ in range(4):
        with pytest.raises(ClusterError) as info:
            ip.run_line_magic("cluster", 'start -n 2 --engines slurm --timeout 30 --slurm-args "--partition=nosuch --time=5"')
        text = str(info.value)
        assert "the slurm launcher could not start the engines" in text and "invalid partition specified: nosuch" in text, text
        assert slurm.jobs() == []
        deadline = time.perf_counter() + 5  # SIGKILLed: gone once the kernel has reaped them
        while orphan_controllers() and time.perf_counter() < deadline:
            time.sleep(0.1)
        assert orphan_controllers() == [], "a controller outlived the failed start"


def test_the_multi_node_notebook_runs_on_this_slurm(slurm):
    """notebooks/09_multi_node.ipynb under nbval, in its own Jupyter kernel, on the site's Slurm
    (collected only where SLURM_CONF names a Slurm: notebooks/conftest.py)."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
                        "-q", "notebooks/09_multi_node.ipynb"], cwd=root, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    assert slurm.jobs() == []  # the notebook's %cluster stop left nothing queued
