"""%commbench on 2 real gloo ranks, and its pure parts (sizes, factors, the alpha-beta fit)."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from nbtool.collectives import bus_factor
from nbtool.commbench import BENCH_OPS, CommbenchLinks, CommbenchResult, fit_alpha_beta, link_groups, parse_size, \
    size_sweep


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather", 2, 0.5), ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875),
    ("all_to_all", 4, 0.75), ("broadcast", 8, 1.0), ("reduce", 4, 1.0), ("send", 2, 1.0),
])
def test_bus_factors_follow_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_sizes():
    assert parse_size("4B") == 4 and parse_size("64K") == 65536 and parse_size("1.5MiB") == 3 * 2**19
    assert size_sweep("4B:64B", 2) == [4, 8, 16, 32, 64]
    assert size_sweep("1MB", 2) == [2**20]
    assert size_sweep("1KB:1MB", 32) == [1024, 32768, 1048576]
    for spec, factor, fragment in [("4Q", 2, "is not a number with an optional unit"),
                                   ("1MB:4B", 2, "min 1048576 B > max 4 B"),
                                   ("0:4B", 2, "the smallest size must be > 0"),
                                   ("4B:64B", 1, "--factor 1 must be > 1")]:
        with pytest.raises(ValueError, match=fragment):
            size_sweep(spec, factor)


@pytest.mark.parametrize("op,n", [("all_reduce", 2), ("all_gather", 4)])
def test_alpha_beta_fit_recovers_known_parameters(op, n):
    alpha, bw = 25e-6, 3.2e9
    sizes = [2**k for k in range(4, 28, 2)]
    times = [alpha + bus_factor(op, n) * s / bw for s in sizes]
    fit = fit_alpha_beta(op, n, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.bus_bandwidth == pytest.approx(bw, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-9
    noisy = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(times)]  # +-5% noise
    rough = fit_alpha_beta(op, n, sizes, noisy)
    assert rough.alpha_s == pytest.approx(alpha, rel=0.1) and rough.bus_bandwidth == pytest.approx(bw, rel=0.1)
    assert 0.9 < rough.r2 < 1.0


@pytest.mark.parametrize("nodes,groups", [
    ([0, 0, 1, 1], {"intra-host": (0, 1), "inter-host": (0, 2)}),
    ([0, 1, 1, 1], {"intra-host": (1, 2, 3), "inter-host": (0, 1)}),  # the first host with two ranks
    ([0, 1], {"inter-host": (0, 1)}),  # one rank per host: no intra-host link
    ([0, 0, 0], {}),  # one host: the whole sweep is the one link
])
def test_each_link_is_measured_by_the_ranks_that_use_only_it(nodes, groups):
    assert link_groups(nodes) == groups


def _fitted(link: str, ranks: list, alpha: float, bw: float) -> CommbenchResult:
    sizes = [2**k for k in range(10, 20, 3)]
    rows = [[{"op": "all_reduce", "count": s // 4, "size_bytes": s, "dtype": "float32", "rank": r,
              "seconds": alpha + bus_factor("all_reduce", len(ranks)) * s / bw,
              "samples": [alpha + bus_factor("all_reduce", len(ranks)) * s / bw], "wrong": 0, "clock": "wall"}
             for s in sizes] for r in ranks]
    return CommbenchResult.from_rank_rows(rows, backend="gloo", ranks=ranks, dtype="float32", iters=1, warmup=0,
                                          inplace=False, link=link, label=link or "all ranks")


def test_the_planner_takes_each_link_from_its_own_sweep(tmp_path):
    from nbtool.plan.inputs import Hardware

    links = CommbenchLinks([_fitted("", [0, 1, 2, 3], 80e-6, 0.5e9), _fitted("intra-host", [0, 1], 20e-6, 4e9),
                            _fitted("inter-host", [0, 2], 90e-6, 0.3e9)])
    hw = Hardware("2 hosts", 2, 2, 1e9, 1e9, 1.0, 1.0).with_commbench(links)
    assert hw.intra_bw == pytest.approx(4e9) and hw.intra_latency == pytest.approx(20e-6)
    assert hw.inter_bw == pytest.approx(0.3e9) and hw.inter_latency == pytest.approx(90e-6)  # not the mixed world's
    assert hw.measured and links.fits is links.results[0].fits
    assert "(inter-host link): gloo, ranks [0, 2]" in links.text()
    links.export(tmp_path / "links.json")
    again = CommbenchLinks.load(tmp_path / "links.json")
    assert [r.link for r in again.results] == ["", "intra-host", "inter-host"] and again.text() == links.text()
    one = Hardware("1 host", 1, 2, 1e9, 1e9, 1.0, 1.0).with_commbench(_fitted("", [0, 1], 20e-6, 4e9))
    assert one.intra_bw == pytest.approx(4e9) and one.inter_bw == 1.0  # a plain sweep within a node


def test_each_op_a_sweep_fitted_keeps_its_own_link():
    """Within a node every op %commbench fitted is that op's link (gloo's reduce-scatter is slower per bus
    byte than its all-gather); an op it did not sweep takes the generic (all_reduce) link."""
    from nbtool.plan.inputs import Hardware

    res = _fitted("", [0, 1], 20e-6, 4e9)
    sizes = [2**k for k in range(10, 20, 3)]
    slow = [[{"op": "reduce_scatter", "count": s // 4, "size_bytes": s, "dtype": "float32", "rank": r,
              "seconds": 50e-6 + bus_factor("reduce_scatter", 2) * s / 1e9, "wrong": 0, "clock": "wall",
              "samples": [50e-6 + bus_factor("reduce_scatter", 2) * s / 1e9]} for s in sizes] for r in (0, 1)]
    res.fits.update(CommbenchResult.from_rank_rows(slow, backend="gloo", ranks=[0, 1], dtype="float32", iters=1,
                                                   warmup=0, inplace=False).fits)
    hw = Hardware("1 host", 1, 2, 1e9, 1e9, 1.0, 1.0).with_commbench(res)
    assert hw.bandwidth(2, "reduce_scatter") == pytest.approx((50e-6, 1e9))
    assert hw.bandwidth(2, "all_gather") == pytest.approx((20e-6, 4e9)) == hw.bandwidth(2)
    assert hw.collective_s("reduce_scatter", 2, 3, 2e9) == pytest.approx(3 * 50e-6 + 2.0)
    assert hw.bandwidth(4, "reduce_scatter") == (hw.inter_latency, hw.inter_bw)  # across nodes: the network


def test_nodes_and_devices_per_node_come_from_where_the_ranks_run():
    from nbtool.launchers import Place
    from nbtool.plan.detect import hardware_from_facts

    places = [Place("a", "10.0.0.1", 0, 0, 2, "x", 1), Place("a", "10.0.0.1", 0, 1, 2, "x", 2),
              Place("b", "10.0.0.2", 1, 0, 2, "y", 3), Place("b", "10.0.0.2", 1, 1, 2, "y", 4)]
    hw = hardware_from_facts({"host_memory": 64 * 2**30}, 4, "gloo", places)
    assert (hw.nodes, hw.devices_per_node, hw.devices) == (2, 2, 4)
    assert hw.name == "2 hosts x 2 CPU ranks (gloo)" and hw.device_memory == 32 * 2**30  # a host's RAM, halved
    assert hw.bandwidth(2) == (hw.intra_latency, hw.intra_bw) and hw.bandwidth(4) == (hw.inter_latency, hw.inter_bw)
    one = hardware_from_facts({"host_memory": 64 * 2**30}, 4, "gloo", places[:1] * 4)
    assert (one.nodes, one.devices_per_node) == (1, 4) and one.name == "4 CPU ranks (gloo, this machine)"
    gpus = {"host_memory": 2**40, "gpus": [{"name": "H100", "memory": 80 * 2**30}]}
    assert hardware_from_facts(gpus, 4, "nccl", places).name == "2 hosts x 2x H100"


def test_repeats_take_the_slowest_rank_per_repeat_then_the_median():
    """Each repetition is one nccl-tests measurement (the slowest rank); the result is their median."""
    def row(rank, samples):
        return {"op": "all_reduce", "count": 256, "size_bytes": 1024, "dtype": "float32", "rank": rank,
                "seconds": sorted(samples)[1], "samples": samples, "wrong": 0, "clock": "wall"}

    res = CommbenchResult.from_rank_rows([[row(0, [1.0, 5.0, 3.0])], [row(1, [2.0, 1.0, 4.0])]], backend="gloo",
                                         ranks=[0, 1], dtype="float32", iters=1, warmup=0, inplace=False, repeat=3)
    (r,) = res.rows
    assert (r["rep_min_s"], r["seconds"], r["rep_max_s"]) == (2.0, 4.0, 5.0)  # per-repeat maxima 2, 5, 4
    assert (r["min_s"], r["max_s"]) == (2.0, 3.0)  # the ranks' own medians
    assert "3 passes x 1 iters" in res.text()


def test_every_op_gives_correct_values(ip, cluster, capsys):
    res = ip.run_line_magic("commbench", "all_reduce all_gather reduce_scatter broadcast all_to_all "
                                         "--sizes 8B:1MB --factor 16 --iters 3 --warmup 1")
    assert isinstance(res, CommbenchResult)
    assert {r["op"] for r in res.rows} == set(BENCH_OPS)
    assert res.wrong == 0 and all(r["wrong"] == 0 for r in res.rows)
    assert res.backend == "gloo" and res.ranks == [0, 1]
    for r in res.rows:
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["seconds"] > 0
        assert r["rep_min_s"] <= r["seconds"] <= r["rep_max_s"]  # the median of the repeats, inside their spread
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["op"], 2))
        assert r["algbw"] == pytest.approx(r["size_bytes"] / r["seconds"])
        assert r["clock"] == "wall"
    sizes = sorted({r["size_bytes"] for r in res.rows if r["op"] == "all_reduce"})
    assert sizes == [8, 128, 2048, 32768, 524288]
    assert set(res.fits) == set(BENCH_OPS)
    text = res.text(deterministic=True)
    assert "busfactor" in text and "#wrong" in text and "time(us)" not in text


def test_min_batch_gives_short_sizes_more_calls(ip, cluster):
    """--min-batch-ms: a size whose --iters calls would take less than the floor gets more calls, the same on
    both ranks (else the ranks' collectives would not pair up and the sweep would hang or fail)."""
    res = ip.run_line_magic("commbench", "all_reduce --sizes 4B:4KB --factor 32 --iters 2 --repeat 3 --warmup 1 "
                                         "--min-batch-ms 30")
    assert res.wrong == 0 and res.min_batch_s == 0.03
    for r in res.rows:
        # a small gloo all-reduce takes 0.2-4 ms here (a fast call or a vCPU's wake-up), never 15 ms: two
        # calls cannot fill 30 ms. How many more depends on the spell the probes fell in, so no finer bound
        assert r["iters"] > 2, r
    assert "iters column" in res.text() and "iters" in res.text().splitlines()[1]
    assert "iters" not in res.text(deterministic=True).splitlines()[1]  # calls per size vary with timing
    plain = ip.run_line_magic("commbench", "all_reduce --sizes 4B:4KB --factor 32 --iters 2 --repeat 1 --warmup 1")
    assert all(r["iters"] == 2 for r in plain.rows) and "iters column" not in plain.text()


def test_inplace_bfloat16_and_subset(ip, cluster):
    res = ip.run_line_magic("commbench", "all_gather,reduce_scatter --sizes 1KB:64KB --factor 8 --iters 2 "
                                         "--inplace --dtype bfloat16 --ranks 0,1")
    assert res.inplace and res.dtype == "bfloat16" and res.wrong == 0
    assert all(r["size_bytes"] % (2 * 2) == 0 for r in res.rows)  # bf16 elements, divisible by n


def test_export_and_overlay(ip, cluster, tmp_path):
    a = ip.run_line_magic("commbench", "--sizes 1KB:1MB --factor 32 --iters 2 --label first")
    path = tmp_path / "bench.json"
    a.export(str(path))
    back = CommbenchResult.load(str(path))
    assert back.rows == a.rows and back.fits == a.fits and back.label == "first"
    b = ip.run_line_magic("commbench", "--sizes 1KB:1MB --factor 32 --iters 2 --label second")
    fig = a.figure(b)
    assert {t.name for t in fig.data} == {"first all_reduce", "second all_reduce"}


@pytest.mark.parametrize("line,fragment", [
    ("all_sum", "unknown op 'all_sum'; allowed: all_reduce, all_gather"),
    ("--sizes 4Q", "size '4Q' is not a number with an optional unit"),
    ("--sizes 1MB:4B", "min 1048576 B > max 4 B"),
    ("--dtype int8", "--dtype 'int8' is not known; allowed: float32, bfloat16, float16"),
    ("--iters 0", "value '0' is not valid; expected an integer >= 1"),
    ("--min-batch-ms -5", "--min-batch-ms -5: must be between 0 (off) and 60000"),
    ("--ranks 0", "needs at least 2 ranks"),
    ("--ranks 0,5", "rank 5 does not exist"),
    ("--sizes 1B:1GB --factor 1.01", "use a larger --factor or a narrower range"),
    ("all_reduce all_reduce", "op listed twice"),
])
def test_commbench_refuses_nonsense(ip, cluster, line, fragment):
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("commbench", line)
    assert fragment in str(info.value)


def test_commbench_needs_a_cluster():
    from IPython.testing.globalipapp import start_ipython

    from nbtool.magics import NbtoolMagics

    magics = NbtoolMagics(start_ipython())  # a second, cluster-less instance
    with pytest.raises(UsageError, match="no cluster is running"):
        magics.commbench("--sizes 4B")
