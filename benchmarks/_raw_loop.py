"""The hand-written baseline for strategy_overhead.py, launched with torchrun.

    torchrun --nproc_per_node 2 benchmarks/_raw_loop.py ddp|zero3 STEPS WARMUP
    torchrun --nproc_per_node 2 benchmarks/_raw_loop.py --serve DIR

Plain DistributedDataParallel or deepspeed.initialize (with the same DeepSpeed
config nbtool generates), the same model, data and loop. The first form runs
once and prints the per-step wall times of rank 0 as JSON on its last line.
The second keeps the workers warm, as the engines of the nbtool arm are: for
each request ``DIR/K.req`` (K = 0, 1, ...; JSON ``[name, steps, warmup]``,
with ``train_steps``' turns as a fourth item where the loop takes turns with
another job, or ``"stop"``) it runs the loop and rank 0 writes the times to
``DIR/K.json``.
"""
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import torch.distributed as dist

from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
from nbtool.spec import StrategySpec, deepspeed_config

MODEL = dict(vocab=256, dim=256, heads=4, layers=4, seq=32)


def main():
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("gloo")
    if sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]))
    else:
        times = train_steps(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
        if dist.get_rank() == 0:
            print(json.dumps(times))
    dist.destroy_process_group()


def serve(folder: Path, idle_s: float = 1800.0) -> None:
    """Answer numbered requests in ``folder`` until "stop", or until none came for ``idle_s``."""
    for k in itertools.count():
        req = folder / f"{k}.req"
        deadline = time.monotonic() + idle_s
        while not req.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        ask = json.loads(req.read_text())
        if ask == "stop":
            return
        times = train_steps(*ask)
        if dist.get_rank() == 0:
            tmp = folder / f"{k}.tmp"
            tmp.write_text(json.dumps(times))
            tmp.rename(folder / f"{k}.json")  # whole or absent for the reader


_ds_ready = []


def train_steps(name: str, steps: int, warmup: int, turns: list | None = None) -> list[float]:
    """The hand-written loop on an initialised process group; per-step wall times after warm-up.

    ``turns``: None, or [folder, this job, the other job, its ranks]: each step then waits for its
    turn and gives the other job the next (_turns.py), outside the timing.
    """
    if turns:
        from _turns import Turns

        turns = Turns(*turns, dist.get_rank())
    torch.manual_seed(0)
    model = TinyTransformer(**MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        backward, step = (lambda loss: loss.backward()), (lambda: (opt.step(), opt.zero_grad()))
    else:
        import deepspeed
        import deepspeed.ops as ops

        if not _ds_ready:
            vars(ops).setdefault("__compatible_ops__", {"deepspeed_shm_comm": False})
            deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
            _ds_ready.append(True)
        cfg = deepspeed_config(StrategySpec(name), dist.get_world_size())
        model, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        backward, step = model.backward, model.step
    data = SyntheticTokens(samples=4096, seq=MODEL["seq"], vocab=MODEL["vocab"])
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    times = []
    for i, (x, y) in enumerate(loader):
        turns and turns.wait()
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        backward(loss)
        step()
        loss.item()  # as strategy.log(loss=loss) does in the nbtool cell
        times.append(time.perf_counter() - t0)
        turns and turns.give()
        if i + 1 == warmup + steps:
            break
    turns and turns.close()
    if name != "ddp":
        # untimed: in strategy_overhead's in-engine arm the ipyparallel engine outlives the loop, and a DeepSpeed
        # engine left alive (autograd hooks close over it) burdens its every later round, nbtool's cells included
        from nbtool.rank.strategies.zero import _release_deepspeed_globals

        model.destroy()
        _release_deepspeed_globals()
    return times[warmup:]


if __name__ == "__main__":
    main()
