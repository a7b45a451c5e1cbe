"""Faults on real ranks: a rank killed mid-collective, a hang, an error while peers wait,
Ctrl-C on a blocked rank, engines lost while idle; and checkpoints that survive them.

Each damaging test ends with ``%cluster restart`` so the session cluster is whole again.
"""
from __future__ import annotations

import _thread
import os
import re
import signal
import threading
import time

import pytest
import torch
from helpers import alive, run

from nbtool.execution import UNRESPONSIVE_S, CellTimeout, RankError, RanksInterrupted, RanksUnresponsive

LOOP = """x = torch.ones(1000)
import time
for i in range(100000):
    dist.all_reduce(x)
    if i % 50 == 0:
        print('step', i)
    time.sleep(0.002)
"""


def _restart(ip, capsys):
    res, _, _ = run(ip, capsys, "%cluster restart")
    assert res.success
    res, out, _ = run(ip, capsys, "%%distributed\nt = torch.ones(1); dist.all_reduce(t); print('ok', t.item())")
    assert res.success and "[rank 1] ok 2.0" in out


def test_rank_killed_mid_collective(ip, cluster, capsys):
    rc = cluster
    victim, survivor = rc.pids[1], rc.pids[0]
    killed_at = []

    def kill():
        time.sleep(2.0)
        killed_at.append(time.perf_counter())
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill).start()
    res, out, _ = run(ip, capsys, "%%distributed\n" + LOOP)
    reported = time.perf_counter() - killed_at[0]
    err = res.error_in_exec
    assert isinstance(err, RankError)
    # the dead rank first, with how it ended and its last output; the survivor's broken collective after it
    assert str(err).startswith("rank 1: RankDied: rank 1 died during the cell: its process vanished"), str(err)
    assert "SIGKILL" in str(err) and "its last output: " in str(err) and "step" in str(err)
    assert [g[0] for g in err.groups] == [[1], [0]]
    text = "\n".join(err._render_traceback_())
    assert "rank 0: RuntimeError:" in text and "Connection" in text
    assert "%cluster restart brings back 2 rank(s)" in text
    assert reported < 10, reported
    assert alive([survivor]) == [survivor]  # the survivor was released, not killed
    status = ip.run_line_magic("cluster", "status")
    assert [r["state"] for r in status.rows] == ["ready", "lost"]
    assert "process group unusable" in status.header
    res, _, _ = run(ip, capsys, "%%distributed\nprint(1)")
    assert "rank(s) 1 are no longer connected" in str(res.error_in_exec)
    _restart(ip, capsys)


def test_engine_lost_while_idle_is_named_at_the_next_cell(ip, cluster, capsys):
    rc = cluster
    os.kill(rc.pids[0], signal.SIGKILL)
    deadline = time.perf_counter() + 10
    while rc.lost_ranks() != [0] and time.perf_counter() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    res, _, _ = run(ip, capsys, "%%distributed\nprint(1)")
    assert time.perf_counter() - t0 < 2  # a message, not a stall
    msg = str(res.error_in_exec)
    assert "rank(s) 0 are no longer connected" in msg and "%cluster restart brings back 2 fresh rank(s)" in msg
    _restart(ip, capsys)


def test_frozen_engine_is_named_at_the_next_cell_not_a_stall(ip, cluster, capsys):
    """An engine that stops responding while idle (SIGSTOP, as a suspended machine would)."""
    rc = cluster
    os.kill(rc.pids[1], signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        res, out, _ = run(ip, capsys, "%%distributed\nprint('hello', rank)")
        elapsed = time.perf_counter() - t0
    finally:
        os.kill(rc.pids[1], signal.SIGCONT)
    err = res.error_in_exec
    assert isinstance(err, RanksUnresponsive), err
    assert str(err).startswith(f"rank 1 did not start the cell within {UNRESPONSIVE_S:g}s: the engine does not "
                               "respond (its process is stopped or suspended")
    assert "[rank 0] hello 0" in out
    assert UNRESPONSIVE_S <= elapsed < UNRESPONSIVE_S + 5
    _restart(ip, capsys)


def test_hang_is_reported_with_op_sequence_and_stacks(ip, cluster, capsys):
    rc = cluster
    t0 = time.perf_counter()
    res, out, err = run(ip, capsys, """%%distributed --collective-timeout 3 --timeout 12
x = torch.ones(256)
for i in range(3):
    dist.all_reduce(x)
if rank == 0:
    dist.all_reduce(x)          # rank 1 skips this one
else:
    import time
    for _ in range(400):
        time.sleep(0.05)
""")
    report = rc.last_hang
    assert report is not None
    text = report.text()
    assert text in err  # printed while the cell ran
    assert "rank 0 blocked in a collective for more than 3s" in text
    # sequence numbers count every collective of the engine's life
    seq = int(re.search(r"rank 0: in all_reduce #(\d+) \(1\.00 KiB, float32, group of 2\)", text).group(1))
    assert "dist.all_reduce(x)          # rank 1 skips this one" in text  # rank 0's Python line
    assert f"rank 1: running Python, not in a collective; {seq - 1} collective(s) issued" in text
    assert "time.sleep(0.05)" in text  # rank 1's stack, through SIGUSR1
    assert f"rank 1 never reached collective #{seq}" in text
    exc = res.error_in_exec
    assert isinstance(exc, CellTimeout)
    assert "rank 0 was released by closing the process group on rank 1" in str(exc)
    assert time.perf_counter() - t0 < 12 + 3 + 3 + 5
    assert rc.group_closed
    # the variables are still there; collectives are refused until a restart
    res, out, _ = run(ip, capsys, "%%distributed\nprint('i =', i)")
    assert "[rank 0] i = 2" in out
    res, _, _ = run(ip, capsys, "%%distributed ddp\npass")
    assert "process group is unusable" in str(res.error_in_exec)
    _restart(ip, capsys)


def test_error_while_peers_wait_in_a_collective(ip, cluster, capsys):
    t0 = time.perf_counter()
    res, _, _ = run(ip, capsys, """%%distributed
x = torch.ones(8)
if rank == 1:
    raise ValueError('bad batch on rank 1')
dist.all_reduce(x)
""")
    elapsed = time.perf_counter() - t0
    err = res.error_in_exec
    assert isinstance(err, RankError)
    assert str(err) == "rank 1: ValueError: bad batch on rank 1"  # the real error first
    assert [g[0] for g in err.groups] == [[1], [0]]
    text = "\n".join(err._render_traceback_())
    assert "rank 0 was released by closing the process group on rank 1" in text
    assert elapsed < 15, elapsed
    _restart(ip, capsys)


def test_interrupt_of_a_rank_blocked_in_a_collective(ip, cluster, capsys):
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    t0 = time.perf_counter()
    res, _, _ = run(ip, capsys, """%%distributed
import time
x = torch.ones(4)
if rank == 0:
    dist.all_reduce(x)
""")
    timer.join()
    err = res.error_in_exec
    assert isinstance(err, RanksInterrupted)
    assert "interrupted rank 0; rank 0 was released by closing the process group on rank 1" in str(err)
    assert time.perf_counter() - t0 < 15
    status = ip.run_line_magic("cluster", "status")
    assert [r["state"] for r in status.rows] == ["ready", "ready"]  # not wedged
    _restart(ip, capsys)


def test_interrupt_with_every_rank_blocked_restarts_the_engines(ip, cluster, capsys):
    rc = cluster
    old = list(rc.pids)
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    res, _, _ = run(ip, capsys, """%%distributed
x = torch.ones(4)
if rank == 0:
    dist.all_reduce(x)
else:
    dist.broadcast(x, src=0)  # never matches rank 0's all_reduce: both wait
""")
    timer.join()
    err = res.error_in_exec
    assert isinstance(err, (RanksInterrupted, RankError)), err
    if isinstance(err, RanksInterrupted):  # gloo may instead fail the mismatch itself
        assert "the engines were restarted" in str(err)
        assert set(old).isdisjoint(rc.pids)
        assert alive(old) == []
    _restart(ip, capsys)


# -- checkpoints ---------------------------------------------------------------------

SETUP = """from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
torch.manual_seed(0)
model = TinyTransformer(vocab=64, dim=32, heads=2, layers=2)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
model, opt = strategy.prepare(model, opt)
data = SyntheticTokens(samples=32, seq=8, vocab=64)
"""
TRAIN = """for x, y in strategy.dataloader(data, batch_size=4):
    loss = lm_loss(model(x), y); strategy.backward(loss); opt.step(); opt.zero_grad(); strategy.log(loss=loss)
"""


def _pull(ip, name):
    ip.run_line_magic("dist_pull", f"{name} --rank 0")
    return ip.user_ns[name]


def _train(ip, capsys, line: str, body: str):
    """Run ``body`` under ``%%distributed LINE --no-metrics --quiet``, which must succeed."""
    res, _, _ = run(ip, capsys, f"%%distributed {line} --no-metrics --quiet\n{body}")
    assert res.success, (line, res.error_in_exec)


def test_checkpoint_weights_identical_across_strategies(ip, cluster, capsys, tmp_path):
    path = str(tmp_path / "ck")
    _train(ip, capsys, "ddp", f"{SETUP}{TRAIN}ref = strategy.full_state_dict()\nsaved = strategy.save({path!r})\n")
    ref = _pull(ip, "ref")
    assert sorted(os.listdir(path)) == ["ckpt-000004-" + _pull(ip, "saved")["dir"][-8:], "latest"]
    for name in ("fsdp", "zero3", "zero1", "ddp"):
        _train(ip, capsys, name, f"{SETUP}info = strategy.load({path!r})\nsd = strategy.full_state_dict()\n")
        sd, info = _pull(ip, "sd"), _pull(ip, "info")
        assert sorted(sd) == sorted(ref)
        assert all(torch.equal(sd[k], ref[k]) for k in ref), name
        assert info["steps"] == 4 and info["saved_by"] == "ddp"
        assert info["restored"] == ("model and optimizer" if name == "ddp" else
                                    "model only (optimizer state was saved by ddp on 2 rank(s), pipeline 1x1; "
                                    "it restores only under the same strategy, world size and pipeline split)")


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_resume_continues_exactly(ip, cluster, capsys, tmp_path, strategy):
    """Save mid-run, keep training; a fresh cell that loads and trains the same steps lands on the same weights."""
    path = str(tmp_path / strategy)
    _train(ip, capsys, strategy, f"{SETUP}{TRAIN}strategy.save({path!r})\n{TRAIN}a = strategy.full_state_dict()\n")
    _train(ip, capsys, strategy, f"{SETUP}info = strategy.load({path!r})\n{TRAIN}b = strategy.full_state_dict()\n")
    a, b, info = _pull(ip, "a"), _pull(ip, "b"), _pull(ip, "info")
    assert info["restored"] == "model and optimizer"
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_magic_and_checkpoint_every(ip, cluster, capsys, tmp_path):
    path = str(tmp_path / "every")
    _train(ip, capsys, f"zero3 --checkpoint-every 2 --checkpoint-dir {path}", f"{SETUP}{TRAIN}")
    from nbtool.checkpoint_layout import read_meta

    assert read_meta(path)["steps"] == 4 and read_meta(path)["strategy"] == "zero3"
    assert len([d for d in os.listdir(path) if d.startswith("ckpt-")]) == 1  # older ones pruned
    res, out, _ = run(ip, capsys, f"%dist_checkpoint load {path}")
    assert res.success and f"loaded step 4 from {path}/ckpt-000004-" in out and "model and optimizer" in out
    res, out, _ = run(ip, capsys, f"%dist_checkpoint save {path}2")
    assert res.success and f"saved step 4 to {path}2/ckpt-000004-" in out
    res, _, _ = run(ip, capsys, f"%dist_checkpoint load {tmp_path}/nothing")
    assert "does not exist; save one with %dist_checkpoint save PATH" in str(res.error_in_exec)


def test_killed_save_leaves_the_previous_checkpoint(ip, cluster, capsys, tmp_path):
    path = str(tmp_path / "atomic")
    _train(ip, capsys, "ddp", f"{SETUP}{TRAIN}first = strategy.full_state_dict()\nstrategy.save({path!r})\n")
    first = _pull(ip, "first")
    # rank 1 dies half-way through the next save: after the model files, before the optimizer's
    res, _, _ = run(ip, capsys, f"""%%distributed ddp --no-metrics --quiet
{SETUP}{TRAIN}{TRAIN}
import os, torch.distributed.checkpoint as dcp
_save = dcp.save
def dying_save(sd, checkpoint_id=None, **kw):
    _save(sd, checkpoint_id=checkpoint_id, **kw)
    if rank == 1 and str(checkpoint_id).endswith('optim'):
        os._exit(1)
dcp.save = dying_save
strategy.save({path!r})
""")
    assert isinstance(res.error_in_exec, RankError) and "rank 1 died" in str(res.error_in_exec)
    assert len([d for d in os.listdir(path) if d.startswith("ckpt-")]) == 2  # the partial one is there ...
    _restart(ip, capsys)
    _train(ip, capsys, "fsdp", f"{SETUP}info = strategy.load({path!r})\nsd = strategy.full_state_dict()\n")
    sd, info = _pull(ip, "sd"), _pull(ip, "info")  # ... but the complete one loads
    assert info["steps"] == 4 and all(torch.equal(sd[k], first[k]) for k in first)
