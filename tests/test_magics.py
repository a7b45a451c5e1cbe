"""The magics through a real InteractiveShell, on a real 2-rank gloo cluster."""
from __future__ import annotations

import _thread
import threading
import time

import pytest
from IPython.core.error import UsageError

from helpers import alive, run
from nbtool.execution import CellTimeout, RankError, RanksInterrupted


def test_all_reduce_per_rank_output(ip, cluster, capsys):
    res, out, _ = run(ip, capsys, """%%distributed
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{world_size} sum={t.item():g} backend={dist.get_backend()}")
""")
    assert res.success
    assert "[rank 0] rank 0/2 sum=3 backend=gloo" in out
    assert "[rank 1] rank 1/2 sum=3 backend=gloo" in out
    assert out.index("[rank 0]") < out.index("[rank 1]")


def test_namespace_kept_between_cells(ip, cluster, capsys):
    run(ip, capsys, "%%distributed\nkept = rank * 10")
    res, out, _ = run(ip, capsys, "%%distributed\nprint('kept', kept)")
    assert "[rank 0] kept 0" in out and "[rank 1] kept 10" in out


@pytest.mark.parametrize("magic,expected", [
    ("%%distributed --ranks 1", [1]),
    ("%%distributed --ranks 0,1", [0, 1]),
    ("%%rank 0", [0]),
    ("%%rank 1", [1]),
])
def test_rank_subsets(ip, cluster, capsys, magic, expected):
    res, out, _ = run(ip, capsys, f"{magic}\nprint('here', rank)")
    assert res.success
    for r in (0, 1):
        assert (f"[rank {r}] here {r}" in out) == (r in expected), out


def test_last_expression_shown_per_rank(ip, cluster, capsys):
    _, out, _ = run(ip, capsys, "%%distributed\nrank * 7")
    assert "[rank 0] Out: 0" in out and "[rank 1] Out: 7" in out


def test_error_on_one_rank_names_it(ip, cluster, capsys):
    res, out, _ = run(ip, capsys, """%%distributed
print('before', rank)
if rank == 1:
    raise ValueError(f"bad shard on rank {rank}")
""")
    assert isinstance(res.error_in_exec, RankError)
    assert "rank 1: ValueError: bad shard on rank 1" in out
    assert "[rank 0] before 0" in out  # other ranks' output is kept
    assert "rank 0:" not in out


def test_identical_errors_shown_once(ip, cluster, capsys):
    res, out, _ = run(ip, capsys, "%%distributed\n1 / 0")
    assert isinstance(res.error_in_exec, RankError)
    assert out.count("ranks 0-1: ZeroDivisionError: division by zero") == 1
    assert out.count("ZeroDivisionError") <= 3  # headline + one traceback, not one per rank


def test_different_errors_listed_by_rank(ip, cluster, capsys):
    res, out, _ = run(ip, capsys, "%%distributed\nraise KeyError(rank)")
    assert "rank 0: KeyError: 0" in out and "rank 1: KeyError: 1" in out
    assert out.index("rank 0: KeyError") < out.index("rank 1: KeyError")


def test_stderr_and_carriage_returns(ip, cluster, capsys):
    res, out, err = run(ip, capsys, """%%distributed
import sys
for i in range(3):
    sys.stderr.write(f"\\rstep {i}")
sys.stderr.write("\\n")
""")
    assert "[rank 0] step 2" in err and "[rank 1] step 2" in err
    assert "step 0" not in err  # overwritten by \\r, as a terminal shows it


def test_timeout_names_unfinished_ranks(ip, cluster, capsys):
    t0 = time.perf_counter()
    res, out, _ = run(ip, capsys, """%%distributed --timeout 1.5
import time
if rank == 1:
    time.sleep(60)
print('finished', rank)
""")
    elapsed = time.perf_counter() - t0
    assert isinstance(res.error_in_exec, CellTimeout)
    assert "exceeded --timeout 1.5s; rank 1 had not finished" in str(res.error_in_exec)
    assert "they stopped; the cluster is ready" in str(res.error_in_exec)
    assert "[rank 0] finished 0" in out
    assert elapsed < 10
    res, out, _ = run(ip, capsys, "%%distributed\nprint('alive', rank)")
    assert res.success and "[rank 1] alive 1" in out


def test_interrupt_reaches_every_rank(ip, cluster, capsys):
    run(ip, capsys, "%%distributed\nmarker = 'kept'")
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    t0 = time.perf_counter()
    res, out, _ = run(ip, capsys, """%%distributed
import time
try:
    time.sleep(60)
except KeyboardInterrupt:
    print('interrupted', rank)
    raise
""")
    elapsed = time.perf_counter() - t0
    timer.join()
    assert isinstance(res.error_in_exec, RanksInterrupted), res.error_in_exec
    assert "interrupted ranks 0-1" in str(res.error_in_exec)
    assert "[rank 0] interrupted 0" in out and "[rank 1] interrupted 1" in out
    assert elapsed < 10
    res, out, _ = run(ip, capsys, "%%distributed\nprint(marker, rank)")
    assert "[rank 1] kept 1" in out  # ranks' state survived the interrupt


def test_quiet_hides_output_not_errors(ip, cluster, capsys):
    res, out, err = run(ip, capsys, "%%distributed --quiet\nprint('noise')")
    assert res.success and "noise" not in out + err
    res, out, _ = run(ip, capsys, "%%distributed --quiet\nraise RuntimeError('loud')")
    assert "ranks 0-1: RuntimeError: loud" in out


def test_push_and_pull(ip, cluster, capsys):
    ip.user_ns["lr"] = 0.125
    ip.user_ns["names"] = ["a", "b"]
    ip.run_line_magic("dist_push", "lr names")
    run(ip, capsys, "%%distributed\nscaled = lr * (rank + 1)\nfirst = names[rank]")
    ip.run_line_magic("dist_pull", "scaled first")
    assert ip.user_ns["scaled"] == [0.125, 0.25]
    assert ip.user_ns["first"] == ["a", "b"]
    ip.run_line_magic("dist_pull", "scaled --rank 1")
    assert ip.user_ns["scaled"] == 0.25
    ip.user_ns["only_one"] = 7
    ip.run_line_magic("dist_push", "only_one --ranks 1")
    with pytest.raises(UsageError, match=r"'only_one' is not defined on rank\(s\) 0"):
        ip.run_line_magic("dist_pull", "only_one")


def test_pull_tensor_round_trip(ip, cluster, capsys):
    run(ip, capsys, "%%distributed\nw = torch.arange(4.0) + rank")
    ip.run_line_magic("dist_pull", "w --rank 1")
    assert ip.user_ns["w"].tolist() == [1.0, 2.0, 3.0, 4.0]


BAD_LINES = [
    ("line", "cluster", "", "the following arguments are required: action"),
    ("line", "cluster", "launch", "invalid choice: 'launch'"),
    ("line", "cluster", "start -n 0", "value '0' is not valid; expected an integer >= 1"),
    ("line", "cluster", "start -n two", "value 'two' is not valid"),
    ("line", "cluster", "start", "already running; use %cluster restart"),
    ("line", "cluster", "start --backend mpi", "invalid choice: 'mpi'"),
    ("line", "cluster", "start --gpus x", "--gpus 'x': 'x' is not a number or range"),
    ("line", "cluster", "start --timeout 0", "seconds '0' is not valid; expected a number of seconds > 0"),
    ("line", "cluster", "status -n 3", "-n only apply to %cluster start, not status"),
    ("line", "cluster", "stop --gpus 0", "--gpus only apply to %cluster start, not stop"),
    ("cell", "distributed", "foo", "unknown strategy 'foo'; allowed:"),
    ("cell", "distributed", "--ranks 5", "rank 5 does not exist; this cluster has ranks 0-1"),
    ("cell", "distributed", "--ranks a", "'a' is not a number or range"),
    ("cell", "distributed", "--ranks 1-0", "range 1-0 is backwards"),
    ("cell", "distributed", "--timeout soon", "seconds 'soon' is not valid"),
    ("cell", "distributed", "--bogus", "unrecognized arguments: --bogus"),
    ("cell", "distributed", "ddp --timeline-steps 3", "--timeline-steps 3 needs --memory-timeline"),
    ("cell", "distributed", "fsdp --reduce-every-micro-batch", "it needs --grad-accum N >= 2"),
    ("cell", "distributed", "ddp --grad-accum 2 --reduce-every-micro-batch", "does not apply to ddp"),
    ("cell", "distributed", "ddp --memory-timeline --timeline-steps 0", "--timeline-steps"),
    ("cell", "rank", "", "the following arguments are required: ranks"),
    ("cell", "rank", "7", "rank 7 does not exist"),
    ("line", "dist_push", "never_defined_xyz", "'never_defined_xyz' is not defined in the kernel"),
    ("line", "dist_push", "", "the following arguments are required: names"),
    ("line", "dist_pull", "never_defined_xyz", "'never_defined_xyz' is not defined on rank(s) 0-1"),
    ("line", "dist_pull", "x --rank 9", "--rank 9 does not exist"),
    ("line", "dist_pull", "x --rank -1", "rank '-1'"),
    # argparse would keep the last of two; nbtool cannot tell which one was meant
    ("line", "dist_plan", "--vs ddp --vs fsdp", "--vs is given twice: give it once"),
    ("cell", "distributed", "ddp --precision bf16 --precision=fp32", "--precision is given twice"),
    ("cell", "distributed", "fsdp --reshard-after-forward --no-reshard", "--reshard-after-forward and "
     "--no-reshard-after-forward set the same option: give one"),
]


@pytest.mark.parametrize("kind,magic,line,fragment", BAD_LINES, ids=[f"{m} {l}" for _, m, l, _ in BAD_LINES])
def test_bad_lines_give_usage_errors(ip, cluster, kind, magic, line, fragment):
    with pytest.raises(UsageError) as info:
        if kind == "line":
            ip.run_line_magic(magic, line)
        else:
            ip.run_cell_magic(magic, line, "print('must not run')")
    assert fragment in str(info.value)
    assert len(str(info.value)) < 200  # short, one line


def test_usage_errors_show_no_traceback_and_lose_nothing(ip, cluster, capsys):
    run(ip, capsys, "%%distributed\nsurvivor = rank + 100")
    for line in ("%cluster start -n 0", "%%distributed --ranks 9\nx=1", "%dist_pull nope --rank 5"):
        res, out, err = run(ip, capsys, line)
        assert isinstance(res.error_in_exec, UsageError)
        assert "Traceback" not in out + err
        assert "UsageError" in err
    res, out, _ = run(ip, capsys, "%%distributed\nprint(survivor)")
    assert "[rank 0] 100" in out and "[rank 1] 101" in out


def test_help_comes_from_docstrings(ip):
    cases = [("cluster", "line", "Start, inspect", "--backend"),
             ("distributed", "cell", "Run the cell on every rank", "--ranks"),
             ("rank", "cell", "Run the cell on the given rank", "--timeout"),
             ("dist_push", "line", "Copy kernel variables", "--ranks"),
             ("dist_pull", "line", "Copy rank variables", "--rank")]
    for name, kind, summary, option in cases:
        doc = ip.find_magic(name, kind).__doc__  # what %name? shows
        assert summary in doc and option in doc and f"%{name}" in doc, name


def test_status_table(ip, cluster):
    table = ip.run_line_magic("cluster", "status")
    text = repr(table)
    assert "rank  engine  pid" in text
    rows = table.rows
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["state"] == "ready" and r["backend"] == "gloo" and r["device"] == "cpu" for r in rows)
    assert all(r["rss_bytes"] > 50 * 2**20 for r in rows)  # a process with torch loaded
    assert "<table" in table._repr_html_()


def test_restart_gives_fresh_engines(ip, cluster, capsys):
    """Runs last in this module: it replaces the engines."""
    old = [r["pid"] for r in ip.run_line_magic("cluster", "status").rows]
    ip.run_line_magic("cluster", "restart")
    new = [r["pid"] for r in ip.run_line_magic("cluster", "status").rows]
    assert set(old).isdisjoint(new)
    assert alive(old) == []
    res, out, _ = run(ip, capsys, """%%distributed
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
print('sum', t.item(), 'survivor' in dir())
""")
    assert "[rank 0] sum 3.0 False" in out and "[rank 1] sum 3.0 False" in out
