"""benchmarks/consecutive.py reads what the ratio benchmarks print (through _paired.ratio_line) and judges it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import consecutive  # noqa: E402
from _paired import ratio_line  # noqa: E402


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


def test_bad_arguments_are_named():
    for args, said in ((["nosuch.py"], "nosuch.py: not a benchmark script"),
                       (["dispatch.py", "--runs", "1"], "--runs 1: must be >= 2")):
        out = subprocess.run([sys.executable, str(BENCH / "consecutive.py"), *args], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and said in out.stderr, out.stderr
