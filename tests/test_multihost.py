"""Ranks on two network-isolated hosts through ipyparallel's SSH launcher, and on Open MPI's mpiexec.

The two hosts are network namespaces of this machine (tests/hosts.py): each
has only its own address on ``nbt0`` and loopback, and an sshd. The kernel
(a real IPython shell, tests/multihost_driver.py) runs in the first; one rank
runs in each, started over ssh. Skipped, with the reason, only where this
machine cannot create namespaces.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from helpers import site
from hosts import IFNAME, TwoHosts, unavailable

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    yield from site(TwoHosts, unavailable, "two network-isolated hosts cannot be built on this machine",
                    tmp_path_factory.mktemp("hosts"))


@pytest.fixture(scope="module")
def driven(two_hosts, tmp_path_factory):
    """What the driver saw, run once for the module (one cluster across the two hosts)."""
    cfg = {"hosts": list(two_hosts.addresses), "ssh_config": str(two_hosts.ssh_config),
           "shared": str(two_hosts.shared), "namespaces": list(two_hosts.names),
           "private": str(two_hosts.private)}
    env = dict(os.environ, IPYTHONDIR=str(tmp_path_factory.mktemp("ipython")), PYTHONPATH=str(ROOT))
    r = subprocess.run(["ip", "netns", "exec", two_hosts.names[0], sys.executable,
                        str(ROOT / "tests" / "multihost_driver.py"), json.dumps(cfg)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"driver failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


def test_ranks_on_two_hosts_form_one_world_in_host_order(driven, two_hosts):
    a, b = two_hosts.addresses
    assert driven["sum"] == [3.0, 3.0]  # all_reduce of 1 and 2 across the hosts
    env0, env1 = driven["env"]
    assert env0 == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0",
                    "MASTER_ADDR": a, "GLOO_SOCKET_IFNAME": IFNAME}
    assert env1 == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1",
                    "MASTER_ADDR": a, "GLOO_SOCKET_IFNAME": IFNAME}
    assert driven["places"] == [[a, 0, 0], [b, 1, 0]]
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["state"]) for r in driven["status"]] == [
        (0, 0, 0, "ready"), (1, 1, 0, "ready")]
    assert driven["header"] == (f"launcher ssh: {a}:1, {b}:1; interface {IFNAME}; "
                                f"{driven['status'][0]['host']} ({a}): rank 0; {driven['status'][1]['host']} ({b}): rank 1")


def test_a_ddp_cell_trains_the_same_replica_on_both_hosts(driven):
    w0, w1 = driven["weights"]
    assert w0 == w1  # the gradients were averaged across the hosts: one model
    assert all(len(x) == 3 and all(v == v for v in x) for x in driven["losses"])
    assert driven["losses"][0] != driven["losses"][1]  # each host read its own shard of the data


def test_checkpoints_need_a_directory_every_host_sees(driven, two_hosts):
    b = two_hosts.addresses[1]
    assert driven["checkpoint_shared"] == "saved"
    text = driven["checkpoint_private"]
    assert text.startswith("ClusterError: %dist_checkpoint save") and "not shared with every host" in text, text
    assert f"({b}): rank 1 do not see it" in text, text


def test_nothing_listens_beyond_the_chosen_interface_and_loopback(driven, two_hosts):
    """ipyparallel's controller and gloo listen on nbt0's address only; ipyparallel's nanny and the
    controller's internal sockets on loopback, which no other host can reach; nothing on a wildcard."""
    for i, ns in enumerate(two_hosts.names):
        rows = driven["listening"][ns]
        assert rows, ns
        own = two_hosts.addresses[i]
        for addr, proc in rows:
            host = addr.rsplit(":", 1)[0].strip("[]")
            assert host in (own, "127.0.0.1"), (ns, addr, proc)
        controller = f"pid={driven['pids']['controller']},"
        if i == 0:  # the check above can fail: the controller does listen, on the interface
            assert any(controller in proc and addr.startswith(own + ":") for addr, proc in rows), rows
        rank = f"pid={driven['pids']['ranks'][i]},"
        assert any(rank in proc and addr.startswith(own + ":") for addr, proc in rows), rows  # gloo, on nbt0


def test_the_second_hosts_engine_killed_is_named_as_that_host_lost(driven, two_hosts):
    b = two_hosts.addresses[1]
    text = driven["lost_error"]
    assert "rank 1 on " in text and f"({b})" in text and "died during the cell" in text, text
    assert f"({b}): rank 1 gone" in text, text
    assert driven["lost_s"] < 20, driven["lost_s"]
    assert driven["status_after"] == ["ready", "lost"]
    a = two_hosts.addresses[0]
    assert driven["restarted"] == [[a, 0], [b, 1]] and driven["restarted_sum"] == [2.0, 2.0]  # %cluster restart


def test_the_second_hosts_network_cut_is_named_as_that_host_lost(driven, two_hosts):
    """No process dies: the link goes down under a running cell, and the controller's heartbeat is
    what notices. Rank 0, blocked in a collective with a peer that never answers (no reset comes),
    has its engine stopped rather than a restart that would wait on the cut-off host."""
    b = two_hosts.addresses[1]
    text = driven["cut_error"]
    assert f"({b}): rank 1" in text and " gone" in text, text
    assert "rank 0 stayed blocked in a collective with the lost host's ranks, so its engine was stopped" in text, text
    assert f"once vm ({b}): rank 1 can be reached" in text or f"({b}): rank 1 can be reached" in text, text
    assert driven["cut_s"] < 30, driven["cut_s"]
    assert driven["cut_status"] == ["lost", "lost"], driven["cut_status"]


def test_commbench_measures_each_link_apart_and_the_planner_sees_hosts(driven):
    bench = driven["bench"]
    assert [(r["link"], r["ranks"]) for r in bench] == [("", [0, 1, 2, 3]), ("intra-host", [0, 1]),
                                                        ("inter-host", [0, 2])]
    assert all(r["wrong"] == 0 and r["fit"] and r["sizes"] == 4 for r in bench), bench
    assert [r["label"] for r in bench] == ["all ranks", "intra-host", "inter-host"]
    plan = driven["plan"]
    assert "intra-host and inter-host links from the last %commbench all_reduce fit" in plan, plan
    assert "on 4 x" in plan and "(2 hosts x 2 CPU ranks (gloo), partly measured: the line above)" in plan, plan


def test_stop_leaves_nothing_in_either_namespace(driven, two_hosts):
    for i in range(2):
        left = two_hosts.pids(i) - {p.pid for p in two_hosts.sshd}
        assert not left, [subprocess.run(["ps", "-o", "pid,args", "-p", str(p)], capture_output=True,
                                         text=True).stdout for p in left]


def test_a_kernel_killed_outright_leaves_nothing_on_either_host(driven, two_hosts, tmp_path_factory):
    """After the module's own cluster (driven) has come and gone: a kernel SIGKILLed with its cluster up."""
    cfg = {"hosts": list(two_hosts.addresses), "ssh_config": str(two_hosts.ssh_config),
           "shared": str(two_hosts.shared), "namespaces": list(two_hosts.names),
           "private": str(two_hosts.private), "die": True}
    env = dict(os.environ, IPYTHONDIR=str(tmp_path_factory.mktemp("ipython-die")), PYTHONPATH=str(ROOT))
    r = subprocess.run(["ip", "netns", "exec", two_hosts.names[0], sys.executable,
                        str(ROOT / "tests" / "multihost_driver.py"), json.dumps(cfg)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert "STARTED" in r.stdout and r.returncode == -9, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    deadline = time.monotonic() + 60
    sshd = {p.pid for p in two_hosts.sshd}
    while True:
        left = [two_hosts.pids(i) - sshd for i in range(2)]
        if not any(left):
            break
        assert time.monotonic() < deadline, f"still running 60 s after the kernel died: {left}"
        time.sleep(0.5)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="Open MPI is not installed (.ci/setup installs it as root)")
def test_mpi_launcher_ranks_match_mpis(ip, parked):
    ip.run_line_magic("cluster", "start -n 2 --engines mpi --timeout 90")
    try:
        ip.run_cell("%%distributed --quiet\nimport os\n_mpi = int(os.environ['OMPI_COMM_WORLD_RANK'])\n"
                    "_t = torch.ones(1)\ndist.all_reduce(_t)").raise_error()
        ip.run_line_magic("dist_pull", "_mpi _t")
        assert ip.user_ns["_mpi"] == [0, 1]  # nbtool's rank r is MPI's rank r
        assert [t.item() for t in ip.user_ns["_t"]] == [2.0, 2.0]
        assert "launcher mpiexec" in repr(ip.run_line_magic("cluster", "status"))
    finally:
        ip.run_line_magic("cluster", "stop")


@pytest.mark.parametrize("line,message", [
    ("start --engines pbs", "--engines 'pbs' is not a launcher nbtool starts; choose one of local, ssh, slurm, mpi"),
    ("start -n 4 --hosts node1:2,node2", "--hosts 'node1:2,node2' starts 3 engine(s) but -n is 4"),
    ("start --hosts node1:x", "'node1:x' is not HOST:N"),
    ("start --hosts node1:0", "'node1:0' is not HOST:N"),
    ("start --engines ssh", "--engines ssh needs --hosts HOST:N[,HOST:N]"),
    ("start --engines mpi --hosts a:1", "--hosts applies to --engines ssh"),
    ("start --interface nope0", "--interface 'nope0' does not exist on this machine; interfaces with an address: "),
    ("start --rendezvous file:/nonexistent/dir", "/nonexistent/dir is not a directory"),
    ("start --rendezvous etcd", "--rendezvous 'etcd'; allowed: file:DIR"),
    ("start --engines slurm --gpus 0", "--gpus picks GPUs of this machine"),
    ('start --slurm-args "--partition=x --time=5"', "--slurm-args applies to --engines slurm"),
    ("status --engines ssh", "--engines only apply to %cluster start, not status"),
])
def test_launcher_options_refused_with_the_reason(ip, parked, line, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_line_magic("cluster", line)
    assert ip.magics_manager.registry["NbtoolMagics"].rank_cluster is None or \
        ip.magics_manager.registry["NbtoolMagics"].rank_cluster.running  # nothing started, nothing lost


def test_rendezvous_directory_that_is_not_writable(tmp_path):
    """Root writes anywhere a mode allows, so as root the directory is a read-only bind mount (no user
    switch: a clone in a 0700 directory is out of another user's reach); else mode 0555."""
    from nbtool.options import parse_rendezvous

    locked = tmp_path / "locked"
    locked.mkdir()
    mounted = False
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(locked), str(locked)], check=True, timeout=20)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(locked)], check=True, timeout=20)
    else:
        os.chmod(locked, 0o555)
    try:
        with pytest.raises(UsageError, match=re.escape(f"--rendezvous 'file:{locked}': {locked} is not writable by this user")):
            parse_rendezvous(f"file:{locked}")
    finally:
        if mounted:
            subprocess.run(["umount", str(locked)], timeout=20)
        os.chmod(locked, 0o755)
