"""Three-dimensional parallelism (FSDP over dp 2 x tp 2 x pp 2) on 8 ranks: predicted as it runs, and
advised from its own numbers.

Runs on its own 8-rank cluster (make_cluster); the session's 2-rank cluster waits, parked. 8 ranks on
2 cores are oversubscribed, so one small model and few steps, without --memory-timeline (its analysis
on 8 ranks takes minutes: nbtool.rank.host_turns).
"""
from __future__ import annotations

from collections import Counter

import pytest

import nbtool

CELL = """%%distributed {line} --quiet
torch.manual_seed(0)
model = TinyTransformer(layers=4)
opt = torch.optim.AdamW(model.parameters())
model, opt = strategy.prepare(model, opt, loss_fn=lm_loss)
for s, (x, y) in enumerate(strategy.dataloader(_pdata, batch_size=8, shuffle=False)):
    strategy.forward_backward(x, y); opt.step(); opt.zero_grad()
    if s == 2:
        break
"""


@pytest.fixture(scope="module")
def eight(ip, make_cluster):
    make_cluster(8)
    ip.run_cell("%%distributed --quiet\nfrom nbtool.rank.example_models import TinyTransformer, SyntheticTokens, "
                "lm_loss\n_pdata = SyntheticTokens(256)").raise_error()
    return ip


def test_fsdp_around_tp_and_pp_is_predicted_per_rank_and_advised(eight):
    """fsdp --tp 2 --pp 2: each pipeline rank's stage is split over tp (what the plan left whole, the
    ends' embeddings, norms and head, on each pipeline rank's own) and sharded over dp by FSDP. Each of
    the 8 ranks' model states exactly as predicted (they had been split over tp whole: -9.5%), the bus
    bytes within 2% (-5.1%); advised --no-reshard-after-forward (each unit gathered M + 1 = 5 times a
    step), the advised line run as written measures the bytes it predicted, with one gather a unit."""
    from nbtool.plan.advice import measure

    magics = eight.magics_manager.registry["NbtoolMagics"]
    eight.run_cell(CELL.format(line="fsdp --tp 2 --pp 2")).raise_error()
    v = nbtool.predicted_vs_measured()
    states = [r for r in v.rows if "model states" in r.figure]
    assert len(states) == 9 and all(r.tolerance == 0 and r.within for r in states), v.text()
    bus = v.row("bus bytes / step")
    assert bus.tolerance is not None and bus.within, v.text()
    units = Counter(c.op for c in nbtool.last_run().comms if c.rank == 0 and c.step == 2)["reduce_scatter"]
    assert units == 3  # rank 0's stage: 2 blocks and its root
    (s,) = [s for s in magics.session.advice if "--no-reshard-after-forward" in s.line]
    assert s.line == "fsdp --no-reshard-after-forward --tp 2 --pp 2" and "all-gathered 5 times" in s.why, s
    eight.run_cell(CELL.format(line=s.line)).raise_error()
    run = nbtool.last_run()
    after = measure(run, "bus bytes / step")
    assert after < s.before and abs(after - s.predicted) <= 0.02 * s.before, (s, after)
    assert Counter(c.op for c in run.comms if c.rank == 0 and c.step == 2)["all_gather"] == units  # one a unit
