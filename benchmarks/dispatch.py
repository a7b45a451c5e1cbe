"""Dispatch and start-up overhead of nbtool against raw ipyparallel.

Prints, side by side in one run:
- the median latency of a trivial ``%%distributed`` cell against ``%%px --block``
  on the same 2 engines, both through one real InteractiveShell
  (``dispatch_ratio``, target <= 1.2);
- the time from ``%cluster start -n 2`` to a ready process group against raw
  ``ipyparallel.Cluster(n=2).start_and_connect_sync()`` plus
  ``init_process_group`` on each engine (``start_ratio``, target <= 1.2).
Both are paired and interleaved (benchmarks/_paired.py): each ratio is the
median of >= 5 per-pair ratios, printed with their spread and the verdict.
"""
from __future__ import annotations

import argparse
import statistics
import time

import ipyparallel as ipp

from _paired import alternate, ratio_line
from _shell import nbtool_cluster, shell


def raw_start(n: int = 2) -> tuple[float, ipp.Cluster]:
    from nbtool.cluster import free_port

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    port = free_port()

    def init(rank, world, port):
        import os
        from datetime import timedelta

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=60))
        return dist.get_rank()

    ars = [rc[eid].apply_async(init, r, n, port) for r, eid in enumerate(sorted(rc.ids))]
    [ar.get() for ar in ars]
    elapsed = time.perf_counter() - t0
    rc.close()
    return elapsed, cluster


def median_cell(ip, cell: str, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = ip.run_cell(cell, silent=True)
        times.append(time.perf_counter() - t0)
        res.raise_error()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    # more pairs than the 5 required, so that consecutive runs agree within +-3% (benchmarks/consecutive.py):
    # three runs' medians spanned 3.4% (dispatch, 15 pairs of 20 cells) and 4.0% (start, 9 starts); with
    # these defaults 3.3% and 0.0%
    ap.add_argument("--reps", type=int, default=3050, help="dispatch cells per arm, in all")
    ap.add_argument("--starts", type=int, default=15, help="paired cluster starts (>= 5)")
    ap.add_argument("--pairs", type=int, default=61, help="paired batches of dispatch cells (>= 5)")
    a = ap.parse_args()
    ip = shell()

    def raw_arm():
        t, cluster = raw_start()
        cluster.stop_cluster_sync()
        return t

    def nbtool_arm():
        t0 = time.perf_counter()
        ip.run_line_magic("cluster", "start -n 2")
        t = time.perf_counter() - t0
        ip.run_line_magic("cluster", "stop")
        return t

    nb_starts, raw_starts = alternate(a.starts, nbtool_arm, raw_arm)

    ip.run_line_magic("cluster", "start -n 2")
    rc = nbtool_cluster(ip).client
    view = rc.direct_view(targets=sorted(rc.ids))
    view.activate()  # registers %%px on the same engines
    batch = max(1, a.reps // a.pairs)  # each pair: a batch of cells per arm, its median per arm
    nb_cells, px_cells = alternate(a.pairs, lambda: median_cell(ip, "%%distributed\nx = 1", batch),
                                   lambda: median_cell(ip, "%%px --block\nx = 1", batch))
    ip.run_line_magic("cluster", "stop")

    nb_cell, px_cell = statistics.median(nb_cells), statistics.median(px_cells)
    nb_start, raw_start_s = statistics.median(nb_starts), statistics.median(raw_starts)
    print(f"%%px --block x=1 median:        {px_cell * 1e3:.2f} ms")
    print(f"%%distributed x=1 median:       {nb_cell * 1e3:.2f} ms")
    print(f"raw Cluster start + init_pg:    {raw_start_s:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in raw_starts)})")
    print(f"%cluster start -n 2:            {nb_start:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in nb_starts)})")
    start = ratio_line("start (nbtool / raw ipyparallel)", nb_starts, raw_starts, 1.2)
    dispatch = ratio_line("dispatch (%%distributed / %%px)", nb_cells, px_cells, 1.2)
    print(f"start_ratio={start:.3f}")
    print(f"dispatch_ratio={dispatch:.3f}")

if __name__ == "__main__":
    main()
