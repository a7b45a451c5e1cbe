"""The hand-written baseline for strategy_overhead.py, launched with torchrun.

    torchrun --nproc_per_node 2 benchmarks/_raw_loop.py ddp|zero3 STEPS WARMUP

Plain DistributedDataParallel or deepspeed.initialize (with the same DeepSpeed
config nbtool generates), the same model, data and loop; prints the per-step
wall times of rank 0 as JSON on its last line.
"""
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
import torch.distributed as dist

from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
from nbtool.spec import StrategySpec, deepspeed_config

MODEL = dict(vocab=256, dim=256, heads=4, layers=4, seq=32)


def main():
    name, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("gloo")
    times = train_steps(name, steps, warmup)
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()


_ds_ready = []


def train_steps(name: str, steps: int, warmup: int) -> list[float]:
    """The hand-written loop on an initialised process group; per-step wall times after warm-up."""
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
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        backward(loss)
        step()
        loss.item()  # as strategy.log(loss=loss) does in the nbtool cell
        times.append(time.perf_counter() - t0)
        if i + 1 == warmup + steps:
            break
    if name != "ddp":
        # untimed: in strategy_overhead's in-engine arm the ipyparallel engine outlives the loop, and a DeepSpeed
        # engine left alive (autograd hooks close over it) burdens its every later round, nbtool's cells included
        from nbtool.rank.strategies.zero import _release_deepspeed_globals

        model.destroy()
        _release_deepspeed_globals()
    return times[warmup:]


if __name__ == "__main__":
    main()
