"""benchmarks/consecutive.py reads what the ratio benchmarks print (through _paired.ratio_line) and judges it;
benchmarks/_turns.py makes two jobs alternate step by step, never overlapping; commbench_fidelity's arms
take turns in balanced orders."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import consecutive  # noqa: E402
from commbench_fidelity import williams_orders  # noqa: E402
from _paired import ratio_line  # noqa: E402
from _turns import Pipes  # noqa: E402


def test_figures_reads_the_paired_lines_and_the_final_values(capsys):
    ratio_line("strategy_overhead ddp (nbtool / torchrun)", [1.0, 1.1, 0.9, 1.05, 1.0], [1.0] * 5, 1.05)
    ratio_line("dispatch (%%distributed / %%px)", [2.0] * 5, [1.0] * 5, 1.2)
    print("strategy_overhead_ratio=1.000\nnot a figure: 3")
    found = consecutive.figures(capsys.readouterr().out)
    assert found == {"strategy_overhead ddp (nbtool / torchrun)": 1.0, "dispatch (%%distributed / %%px)": 2.0,
                     "strategy_overhead_ratio": 1.0}


def test_judge_is_plus_minus_three_percent_of_the_middle_run():
    assert consecutive.judge([1.00, 1.029, 0.972]) == (1.029 / 0.972 - 1, True)
    spread, ok = consecutive.judge([1.00, 1.031, 1.0])
    assert not ok and round(spread, 3) == 0.031
    assert not consecutive.judge([0.96, 1.0, 1.0])[1]


def test_williams_orders_balance_who_goes_first_and_who_follows_whom():
    for n in (2, 4, 5):
        orders = williams_orders(n)
        assert all(sorted(o) == list(range(n)) for o in orders)
        firsts = Counter(o[0] for o in orders)
        follows = Counter((o[j], o[j + 1]) for o in orders for j in range(n - 1))
        assert len(firsts) == n and len(set(firsts.values())) == 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_bad_arguments_are_named():
    for args, said in ((["nosuch.py"], "nosuch.py: not a benchmark script"),
                       (["dispatch.py", "--runs", "1"], "--runs 1: must be >= 2")):
        out = subprocess.run([sys.executable, str(BENCH / "consecutive.py"), *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and said in out.stderr, out.stderr


JOB = """
import sys, time
sys.path.insert(0, {bench!r})
import torch.distributed as dist
from _turns import Turns
folder, me, other = sys.argv[1:4]
dist.init_process_group("gloo", init_method=f"file://{{folder}}/{{me}}.store", rank=0, world_size=1)
turns = Turns(folder, me, other, 1, 0, timeout_s=30)
for i in range(4):
    turns.wait()
    with open(f"{{folder}}/log", "a") as f:
        f.write(f"{{me}}{{i}}<")
    time.sleep(0.05)  # a step: the other job must not start inside it
    with open(f"{{folder}}/log", "a") as f:
        f.write(">")
    turns.give()
turns.close()
dist.destroy_process_group()
"""


def test_turns_alternate_step_by_step(tmp_path):
    """Two real jobs (gloo, one rank each) on the pipes: strict alternation from the job given the first turn."""
    code = JOB.format(bench=str(BENCH))
    with Pipes(tmp_path, {"a": 1, "b": 1}) as pipes:
        pipes.give("b")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), me, other])
                 for me, other in (("a", "b"), ("b", "a"))]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert (tmp_path / "log").read_text() == "".join(f"b{i}<>a{i}<>" for i in range(4))
    assert not list(tmp_path.glob("[ab].0"))  # the pipes are gone with the exchange
