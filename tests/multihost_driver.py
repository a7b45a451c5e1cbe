"""Run inside the first network namespace: a real IPython shell with nbtool drives a cluster whose two
ranks are on the two "hosts" (tests/hosts.py), and prints what it saw as one JSON line (``RESULT {...}``).

Usage: python tests/multihost_driver.py '{"hosts": [...], "ssh_config": ..., "shared": ..., "namespaces": [...]}'
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

from IPython.testing.globalipapp import start_ipython


def listeners(ns: str) -> list[list]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnpH"], capture_output=True, text=True,
                         timeout=20).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            rows.append([parts[3], " ".join(parts[5:])])
    return rows


def main() -> None:
    cfg = json.loads(sys.argv[1])
    a, b = cfg["hosts"]
    result: dict = {}
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbtool")
    magics = ip.magics_manager.registry["NbtoolMagics"]
    t0 = time.perf_counter()
    ip.run_line_magic("cluster", f'start --hosts {a}:1,{b}:1 --interface nbt0 --rendezvous file:{cfg["shared"]} '
                                 f'--ssh-args "-F {cfg["ssh_config"]}" --timeout 90')
    result["start_s"] = time.perf_counter() - t0
    cluster = magics.rank_cluster
    if cfg.get("die"):  # the kernel killed outright: no stop, no atexit
        print("STARTED " + json.dumps(cluster.pids), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    status = cluster.status()
    result["status"] = [{k: r.get(k) for k in ("rank", "host", "node_rank", "local_rank", "state")} for r in status]
    result["header"] = repr(ip.run_line_magic("cluster", "status")).splitlines()[0]
    result["places"] = [[p.address, p.node_rank, p.local_rank] for p in cluster.places]
    ip.run_cell("%%distributed --quiet\nimport os\n_env = {k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', "
                "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'MASTER_ADDR', 'GLOO_SOCKET_IFNAME')}\n"
                "_t = torch.ones(1) * (rank + 1)\ndist.all_reduce(_t)\n_sum = _t.item()").raise_error()
    ip.run_line_magic("dist_pull", "_env _sum")
    result["env"], result["sum"] = ip.user_ns["_env"], ip.user_ns["_sum"]
    ip.run_cell("%%distributed ddp --quiet\nfrom nbtool.rank.example_models import TinyTransformer, SyntheticTokens, "
                "lm_loss\nm = TinyTransformer()\no = torch.optim.SGD(m.parameters(), lr=0.1)\nm, o = strategy.prepare(m, o)\n"
                "_losses = []\nfor x, y in strategy.dataloader(SyntheticTokens(64), batch_size=4, shuffle=False):\n"
                "    loss = lm_loss(m(x), y); strategy.backward(loss); o.step(); o.zero_grad()\n"
                "    _losses.append(loss.item())\n    if len(_losses) == 3:\n        break\n"
                "_w = float(sum(p.detach().sum() for p in m.parameters()))").raise_error()
    ip.run_line_magic("dist_pull", "_losses _w")
    result["losses"], result["weights"] = ip.user_ns["_losses"], ip.user_ns["_w"]
    for name, path in (("checkpoint_private", cfg["private"] + "/ckpt"), ("checkpoint_shared", cfg["shared"] + "/ckpt")):
        try:
            ip.run_line_magic("dist_checkpoint", f"save {path}")
            result[name] = "saved"
        except Exception as e:
            result[name] = f"{type(e).__name__}: {e}"
    result["listening"] = {ns: listeners(ns) for ns in cfg["namespaces"]}
    result["pids"] = {"controller": cluster._cluster.controller.process.pid, "ranks": list(cluster.pids)}

    # the second host's engine killed while both ranks run collectives: named as that host lost
    victim = cluster.pids[1]
    threading.Timer(3.0, lambda: os.kill(victim, signal.SIGKILL)).start()
    t0 = time.perf_counter()
    res = ip.run_cell("%%distributed --quiet\nimport time\nfor _ in range(2000):\n"
                      "    dist.all_reduce(torch.ones(1)); time.sleep(0.01)")
    result["lost_s"] = time.perf_counter() - t0 - 3.0
    err = res.error_in_exec
    result["lost_error"] = "\n".join(err._render_traceback_()) if hasattr(err, "_render_traceback_") else str(err)
    result["status_after"] = [r.get("state") for r in cluster.status()]
    ip.run_line_magic("cluster", "restart")  # the same layout again: one rank on each host
    result["restarted"] = [[p.address, p.node_rank] for p in cluster.places]
    ip.run_cell("%%distributed --quiet\n_t = torch.ones(1)\ndist.all_reduce(_t)\n_n = _t.item()").raise_error()
    ip.run_line_magic("dist_pull", "_n")
    result["restarted_sum"] = ip.user_ns["_n"]

    # the second host's network cut while both ranks run collectives: its engine lives on, unreachable
    link = lambda state: subprocess.run(["ip", "netns", "exec", cfg["namespaces"][1], "ip", "link", "set", "nbt0",
                                         state], check=True, timeout=20)
    threading.Timer(3.0, link, ("down",)).start()
    t0 = time.perf_counter()
    try:
        res = ip.run_cell("%%distributed --quiet\nimport time\nfor _ in range(2000):\n"
                          "    dist.all_reduce(torch.ones(1)); time.sleep(0.01)")
    finally:
        result["cut_s"] = time.perf_counter() - t0 - 3.0
        time.sleep(0.5)
        link("up")
    err = res.error_in_exec
    result["cut_error"] = "\n".join(err._render_traceback_()) if hasattr(err, "_render_traceback_") else str(err)
    result["cut_status"] = [r.get("state") for r in cluster.status()]
    ip.run_line_magic("cluster", "stop")

    # two ranks on each host: %commbench measures the links apart, %dist_plan sees 2 hosts x 2
    ip.run_line_magic("cluster", f'start --hosts {a}:2,{b}:2 --interface nbt0 --rendezvous file:{cfg["shared"]} '
                                 f'--ssh-args "-F {cfg["ssh_config"]}" --timeout 120')
    cluster = magics.rank_cluster
    bench = ip.run_line_magic("commbench", "all_reduce --sizes 4KB:256KB --factor 4 --iters 3 --repeat 1 --warmup 1")
    result["bench"] = [{"link": r.link, "ranks": r.ranks, "label": r.label, "wrong": r.wrong,
                        "fit": "all_reduce" in r.fits, "sizes": len(r.rows)} for r in bench.results]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ip.run_line_magic("dist_plan", "--text --model 1m")
    result["plan"] = out.getvalue()
    ip.run_line_magic("cluster", "stop")
    time.sleep(1.0)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
