"""nbtool inside a real Jupyter kernel: live output, rich output, Ctrl-C, and process cleanup.

These drive an ipykernel through jupyter_client exactly as a notebook
frontend does (execute requests, iopub messages, interrupt_kernel).
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from helpers import alive

pytestmark = pytest.mark.slow


def execute(kc, code: str, timeout: float = 120.0):
    """Run code; return (reply content, [(arrival_s, iopub msg)]) for this request."""
    t0 = time.monotonic()
    msg_id = kc.execute(code)
    msgs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msgs.append((time.monotonic() - t0, msg))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    # start_new_kernel may send kernel_info more than once on a slow machine: skip replies to other requests
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], msgs


def streams(msgs, name="stdout") -> str:
    return "".join(m["content"]["text"] for _, m in msgs
                   if m["msg_type"] == "stream" and m["content"]["name"] == name)


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def test_notebook_session(kernel):
    km, kc = kernel
    kpid = km.provisioner.process.pid
    reply, _ = execute(kc, "%load_ext nbtool")
    assert reply["status"] == "ok"

    reply, msgs = execute(kc, "%%distributed\nx = 1")
    assert reply["status"] == "error" and reply["ename"] == "UsageError"
    assert "no cluster is running; start one with %cluster start" in reply["evalue"]

    reply, msgs = execute(kc, "%cluster start -n 2")
    assert reply["status"] == "ok"
    assert any(m["msg_type"] in ("display_data", "update_display_data") and
               "ready: 2 rank(s), backend gloo" in m["content"]["data"]["text/plain"] for _, m in msgs)

    # live output: the first line is on screen while the ranks still sleep
    reply, msgs = execute(kc, """%%distributed
import time
print('first', rank, flush=True)
time.sleep(2.5)
print('second', rank)
""")
    assert reply["status"] == "ok"
    done_at = msgs[-1][0]
    early = [t for t, m in msgs if m["msg_type"] == "update_display_data"
             and "first 0" in m["content"]["data"]["text/plain"]
             and "second" not in m["content"]["data"]["text/plain"]]
    assert early and done_at - early[0] > 1.5, [(t, m["msg_type"]) for t, m in msgs]
    # the final record is plain text in rank order; the live display is blanked
    assert streams(msgs) == "[rank 0]\nfirst 0\nsecond 0\n[rank 1]\nfirst 1\nsecond 1\n"
    first_display = next(m for _, m in msgs if m["msg_type"] == "display_data")
    assert first_display["content"]["data"]["text/plain"] == ""

    # tqdm: progress bars settle to their last state per rank
    reply, msgs = execute(kc, """%%distributed
from tqdm import tqdm
import time
for i in tqdm(range(3), mininterval=0):
    time.sleep(0.2)
""")
    text = streams(msgs)
    assert text.startswith("[ranks 0-1]\n") or text.startswith("[rank 0]\n"), text
    assert text.count("3/3") in (1, 2) and "0/3" not in text

    # rich output from rank 0 only
    reply, msgs = execute(kc, """%%distributed
from IPython.display import HTML, display
display(HTML(f"<b>from rank {rank}</b>"))
""")
    html = [m["content"]["data"].get("text/html") for _, m in msgs if m["msg_type"] == "display_data"]
    assert "<b>from rank 0</b>" in html and "<b>from rank 1</b>" not in html

    # identical errors: one headline naming both ranks, and the cell fails
    reply, msgs = execute(kc, "%%distributed\nimport math\nmath.sqrt(-1)")
    assert reply["status"] == "error" and reply["ename"] == "RankError"
    assert "ranks 0-1: ValueError: math domain error" in "\n".join(reply["traceback"])

    # Ctrl-C in the notebook (a kernel interrupt) reaches every rank
    run_id = kc.execute("%%distributed\nimport time\nstate = 'before'\ntime.sleep(120)")
    time.sleep(3.0)
    t0 = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == run_id
    assert time.monotonic() - t0 < 10
    assert reply["content"]["ename"] == "RanksInterrupted"
    assert "interrupted ranks 0-1" in reply["content"]["evalue"]
    reply, msgs = execute(kc, "%%distributed\nprint(state, rank)")
    assert "before 0" in streams(msgs) and "before 1" in streams(msgs)

    # a strategy cell: live dashboard (a widget updated while the ranks train),
    # then a static plotly copy, then the one-line summary
    reply, msgs = execute(kc, """%%distributed ddp
import time
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
m = TinyTransformer()
model, optimizer = strategy.prepare(m, torch.optim.AdamW(m.parameters()))
for i, (x, y) in enumerate(strategy.dataloader(SyntheticTokens(64), batch_size=4)):
    loss = lm_loss(model(x), y)
    strategy.backward(loss); optimizer.step(); optimizer.zero_grad(); strategy.log(loss=loss)
    time.sleep(0.3)
    if i == 7:
        break
""")
    assert reply["status"] == "ok", reply
    kinds = [(t, m["msg_type"], m["content"]) for t, m in msgs]
    widget_at, live_id = next((t, c["transient"]["display_id"]) for t, k, c in kinds if k == "display_data"
                              and "application/vnd.jupyter.widget-view+json" in c["data"])
    # the widget's output is replaced in place (same display id) by the static copy: plotly's JSON
    # and, with no page to draw it (this client is headless), a PNG made by kaleido
    static_at = next(t for t, k, c in kinds if k == "update_display_data"
                     and c["transient"]["display_id"] == live_id
                     and "application/vnd.plotly.v1+json" in c["data"] and "image/png" in c["data"])
    live_updates = [t for t, k, c in kinds if k == "comm_msg" and widget_at < t < static_at]
    assert len(live_updates) >= 3, kinds  # the figure changed while the ranks trained
    assert static_at - widget_at > 1.5
    assert "ddp: torch.nn.parallel.DistributedDataParallel" in streams(msgs)

    # kernel exit stops every engine and the controller
    procs = descendants(kpid)
    assert len(procs) >= 3  # controller + 2 engines (+ nannies)
    km.shutdown_kernel(now=False)
    assert wait_gone(procs) == []


def test_unload_and_killed_kernel_leave_no_processes(kernel):
    km, kc = kernel
    kpid = km.provisioner.process.pid
    execute(kc, "%load_ext nbtool")
    reply, _ = execute(kc, "%cluster start -n 2")
    assert reply["status"] == "ok"
    procs = descendants(kpid)
    reply, _ = execute(kc, "%unload_ext nbtool")
    assert reply["status"] == "ok"
    assert wait_gone(procs, timeout=5) == []

    # a kernel killed outright (no atexit) still takes its cluster with it
    execute(kc, "%load_ext nbtool")
    reply, _ = execute(kc, "%cluster start -n 2")
    assert reply["status"] == "ok"
    procs = descendants(kpid)
    assert len(procs) >= 3
    os.kill(kpid, signal.SIGKILL)
    assert wait_gone(procs, timeout=15) == []
