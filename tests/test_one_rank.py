"""One rank, as on a machine with one GPU: every data-parallel strategy trains, gives DDP's losses,
and its ledger is what nbtool.plan.expected_ledger says for a group of one.

Runs on its own 1-rank cluster (make_cluster); the session's 2-rank cluster waits, parked. The GPU
check found the case: on one rank DeepSpeed's ZeRO-3 makes each gathered parameter a view of its
partition, so the persistent parameters cost nothing extra there.
"""
from __future__ import annotations

import pytest

import nbtool
from nbtool.plan import expected_ledger
from nbtool.rank.example_models import TinyTransformer

NUMELS = [p.numel() for p in TinyTransformer().parameters()]
CATEGORIES = ("params", "grads", "master_params", "optimizer_state", "other")

SETUP = """%%distributed --quiet
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
_data = SyntheticTokens(64)

def _one(strategy, steps=3):
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = strategy.prepare(model, optimizer)
    losses = []
    for x, y in strategy.dataloader(_data, batch_size=4, shuffle=False):
        loss = lm_loss(model(x), y)
        strategy.backward(loss)
        optimizer.step(); optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == steps:
            break
    return dict(losses=losses, ledger=strategy.memory_ledger().as_dict())
"""


@pytest.fixture(scope="module")
def one(ip, make_cluster):
    make_cluster(1)
    ip.run_cell(SETUP).raise_error()
    return ip


def train(ip, line: str) -> dict:
    ip.run_cell(f"%%distributed {line} --quiet\n_out = _one(strategy)").raise_error()
    ip.run_line_magic("dist_pull", "_out")
    return ip.user_ns["_out"][0]  # one value per rank


def test_one_rank_strategies_give_ddps_losses_and_the_ledger_for_a_group_of_one(one):
    ref = train(one, "ddp")["losses"]
    for line in ("zero3", "fsdp", "zero1", "zero2", "zero3 --precision bf16"):
        name, precision = line.split()[0], "bf16" if "bf16" in line else "fp32"
        out = train(one, line)
        ledger = {c: out["ledger"][c] for c in CATEGORIES}
        assert ledger == expected_ledger(name, precision, NUMELS, 1), line
        if precision == "fp32":
            assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(out["losses"], ref)), (line, out["losses"], ref)
    # ZeRO-3 on one rank: the persistent (small) parameters are views of their partitions
    z3 = expected_ledger("zero3", "fp32", NUMELS, 1)
    assert z3["params"] == 4 * sum(NUMELS) < expected_ledger("zero3", "fp32", NUMELS, 2)["params"] * 2


def test_one_rank_run_moves_no_bus_bytes_and_its_model_states_are_predicted_exactly(one):
    train(one, "zero3")
    v = nbtool.predicted_vs_measured()
    states = v.row("model states")
    assert states.measured == states.predicted > 0
    bus = v.row("bus bytes / step")  # a group of one sends nothing: no broadcast counted either
    assert bus.predicted == 0 and not bus.measured


def test_cuda_peak_of_steps_2_to_n_is_judged_apart_from_the_set_up(one):
    """On CUDA ranks the recorder resets the allocator's peak when step 1 ends, so a run has both the
    set-up's peak (FSDP's moved model awaiting the garbage collector: 3.7 GB on an H200 where steps
    2..N peaked at 2.8) and that of the steps the planner models. A real run with the allocator's
    samples as the recorder takes them on a GPU (synthetic figures: this machine has none): the table
    keeps the run's peak and names the steps' peak and its error in a note."""
    import copy

    from nbtool.metrics import MemorySample
    from nbtool.plan.versus import _percent, calibrate, steps_cuda_peak, versus

    train(one, "ddp")
    run = copy.deepcopy(nbtool.last_run())
    assert steps_cuda_peak(run) is None  # CPU ranks
    t, steps = run.t_start, 40 * 2**20
    run.add([MemorySample(0, t + 0.1, 1, "step", rss=1, cuda_allocated=1, cuda_peak=int(1.6 * steps)),
             MemorySample(0, t + 0.2, 2, "step", rss=1, cuda_allocated=1, cuda_peak=steps - 7, cuda_peak_since=1),
             MemorySample(0, t + 0.3, 3, "step", rss=1, cuda_allocated=1, cuda_peak=steps, cuda_peak_since=1)])
    assert steps_cuda_peak(run) == steps
    v = versus(run, calibrate(run), "this run")
    row = v.row("peak tensor memory")
    assert row.measured == int(1.6 * steps) and row.source.startswith("CUDA allocator peak")
    note = next(n for n in v.notes if n.startswith("steps 2..N peak at 40 MiB on the CUDA allocator"))
    assert f"(predicted {_percent((row.predicted - steps) / steps)})" in note
    assert "the run's peak came before the first optimizer step ended" in note
