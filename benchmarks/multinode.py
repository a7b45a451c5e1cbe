"""Ranks on two network-isolated hosts: nbtool against raw ipyparallel + torch.distributed.

Builds the two "hosts" of the tests (tests/hosts.py: network namespaces joined
by a veth pair, sshd in each; root only), then, inside the first namespace:

- start-to-ready through ipyparallel's SSH launcher: ``%cluster start --hosts
  A:1,B:1`` until its ranks are one gloo world, against raw
  ``ipyparallel.Cluster(engines="ssh")`` + ``init_process_group`` on the same
  hosts with the same rendezvous (a FileStore in the shared directory); arms
  interleaved, ``--rounds`` each, medians: ``multinode_start_ratio`` (target
  <= 1.2);
- ``%commbench all_reduce`` across the hosts against a raw timed loop of
  ``dist.all_reduce`` on the same engines (benchmarks/commbench_fidelity.py's
  loop): busbw per size, medians of interleaved rounds,
  ``multinode_busbw_ratio`` (nbtool / raw, the smallest over sizes).

    sudo .venv/bin/python benchmarks/multinode.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [2**20 * k for k in (1, 4, 16)]


def raw_start(a: str, b: str, ssh_config: str, shared: str) -> float:
    """Seconds from nothing to a 2-rank gloo world with ipyparallel and torch alone; stops it again."""
    import ipyparallel as ipp
    from traitlets.config import Config

    def init(rank, store):
        import os
        from datetime import timedelta

        os.environ["GLOO_SOCKET_IFNAME"] = "nbt0"
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        return dist.get_world_size()

    t0 = time.perf_counter()
    cfg = Config()
    cfg.SSHEngineSetLauncher.engines = {a: 1, b: 1}
    cfg.SSHEngineSetLauncher.ssh_args = ["-F", ssh_config]
    cfg.SSHEngineSetLauncher.scp_args = ["-F", ssh_config]
    cfg.SSHEngineSetLauncher.remote_python = sys.executable
    cluster = ipp.Cluster(n=2, engines="ssh", controller_ip=a, config=cfg, load_profile=False, delay=0)
    cluster.start_controller_sync()
    cluster.start_engines_sync(2)
    client = cluster.connect_client_sync()
    client.wait_for_engines(2, timeout=90)
    store = os.path.join(shared, f"raw-{time.monotonic_ns()}")
    # rank by host, as nbtool does: the engine on A first
    hosts = client[:].apply_sync(lambda: __import__("psutil").net_if_addrs()["nbt0"][0].address)
    order = [eid for _, eid in sorted(zip([h != a for h in hosts], client.ids))]
    ars = [client[eid].apply_async(init, r, store) for r, eid in enumerate(order)]
    assert [x.get(timeout=90) for x in ars] == [2, 2]
    took = time.perf_counter() - t0
    client.close()
    cluster.stop_cluster_sync()
    return took


def _add_path(path: str) -> None:
    import sys

    sys.path.insert(0, path)


def inside(cfg: dict, rounds: int) -> dict:
    """The benchmark, in the first namespace."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from commbench_fidelity import slowest_rank_medians, timed_loop

    from _shell import nbtool_cluster, shell

    a, b = cfg["hosts"]
    ip = shell()
    line = (f'start --hosts {a}:1,{b}:1 --interface nbt0 --rendezvous file:{cfg["shared"]} '
            f'--ssh-args "-F {cfg["ssh_config"]}" --timeout 90')
    starts = {"nbtool": [], "raw": []}

    def nb_start():
        t0 = time.perf_counter()
        ip.run_line_magic("cluster", line)
        starts["nbtool"].append(time.perf_counter() - t0)
        ip.run_line_magic("cluster", "stop")

    def raw_arm():
        starts["raw"].append(raw_start(a, b, cfg["ssh_config"], cfg["shared"]))

    for i in range(rounds):
        for arm in ((nb_start, raw_arm) if i % 2 == 0 else (raw_arm, nb_start)):
            arm()
    ip.run_line_magic("cluster", line)
    view = nbtool_cluster(ip).view([0, 1])
    view.apply_sync(_add_path, str(ROOT / "benchmarks"))  # the raw loop's module, on the ranks
    nb = {s: [] for s in SIZES}
    raw = {s: [] for s in SIZES}
    for i in range(rounds):
        def nbtool_arm():
            res = ip.run_line_magic("commbench", "all_reduce --sizes 1MB:16MB --factor 4 --iters 10 --warmup 3 "
                                                 "--repeat 3 --ranks 0,1")  # one sweep: the link split off
            assert res.wrong == 0
            for r in res.rows:
                nb[r["size_bytes"]].append(r["busbw"])

        def loop_arm():
            seconds = slowest_rank_medians(view.apply_sync(timed_loop, "all_reduce", SIZES, 10, 3, 3))
            for s, t in seconds.items():
                raw[s].append(s / t)  # 2 ranks: busbw = algbw x 2(n-1)/n = algbw

        for arm in ((nbtool_arm, loop_arm) if i % 2 == 0 else (loop_arm, nbtool_arm)):
            arm()
    ip.run_line_magic("cluster", "stop")
    return {"starts": starts, "nb": {str(k): v for k, v in nb.items()}, "raw": {str(k): v for k, v in raw.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inside", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inside:
        print("RESULT " + json.dumps(inside(json.loads(a.inside), a.rounds)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from hosts import TwoHosts, unavailable

    why = unavailable()
    if why:
        sys.exit(f"multinode: two hosts cannot be built here: {why}")
    hosts = TwoHosts(Path(tempfile.mkdtemp(prefix="nbtool-multinode-")))
    try:
        hosts.open()
        cfg = {"hosts": list(hosts.addresses), "ssh_config": str(hosts.ssh_config), "shared": str(hosts.shared)}
        env = dict(os.environ, IPYTHONDIR=tempfile.mkdtemp(prefix="nbtool-multinode-ipython-"),
                   PYTHONPATH=str(ROOT))
        r = subprocess.run(["ip", "netns", "exec", hosts.names[0], sys.executable, __file__, "--rounds",
                            str(a.rounds), "--inside", json.dumps(cfg)], capture_output=True, text=True,
                           timeout=1800, env=env, cwd=ROOT)
    finally:
        hosts.close()
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"multinode: the run inside the namespace failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    nb_s, raw_s = statistics.median(res["starts"]["nbtool"]), statistics.median(res["starts"]["raw"])
    print(f"start to ready over ssh (2 hosts, 1 rank each; {a.rounds} interleaved rounds, medians): "
          f"nbtool {nb_s:.1f} s, raw ipyparallel + init_process_group {raw_s:.1f} s")
    ratios = []
    for s in SIZES:
        n_bw, r_bw = statistics.median(res["nb"][str(s)]), statistics.median(res["raw"][str(s)])
        ratios.append(n_bw / r_bw)
        print(f"all_reduce {s // 2**20:>3} MiB across the hosts: %commbench busbw {n_bw / 1e9:.3f} GB/s, "
              f"raw loop {r_bw / 1e9:.3f} GB/s, ratio {n_bw / r_bw:.3f}")
    print(f"target multinode_start_ratio <= 1.2: {'met' if nb_s / raw_s <= 1.2 else 'NOT met'}")
    print(f"multinode_start_ratio={nb_s / raw_s:.2f}")
    print(f"multinode_busbw_ratio={min(ratios):.3f}")


if __name__ == "__main__":
    main()
