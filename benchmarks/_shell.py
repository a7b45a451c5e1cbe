"""A real IPython shell with nbtool loaded, for benchmarks (not a test fixture)."""
from IPython.testing.globalipapp import start_ipython


def shell():
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbtool")
    return ip


def cluster_shell(n: int = 2):
    """A shell with nbtool loaded and an n-rank cluster started."""
    ip = shell()
    ip.run_line_magic("cluster", f"start -n {n}")
    return ip


def nbtool_cluster(ip):
    return ip.magics_manager.registry["NbtoolMagics"].rank_cluster


# The training cell both overhead benchmarks time (3.4M parameters; the same
# model, data and loop as _raw_loop.py). Per-step wall times of rank 0 end up
# in ``times`` on the ranks. ``{turns}`` (strategy_overhead's pairing,
# _turns.py) is None or [folder, this job, the other job, its ranks]: then each
# step waits for its turn and gives the other job the next, outside the timing.
TRAIN_CELL = """%%distributed {line} --quiet
import time
from nbtool.rank.example_models import SyntheticTokens, TinyTransformer, lm_loss
model = TinyTransformer(vocab=256, dim=256, heads=4, layers=4, seq=32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = strategy.prepare(model, optimizer)
data = SyntheticTokens(samples=4096, seq=32, vocab=256)
turns = {turns} and __import__("_turns").Turns(*{turns}, torch.distributed.get_rank())
times = []
for i, (x, y) in enumerate(strategy.dataloader(data, batch_size=8, shuffle=False)):
    turns and turns.wait()
    t0 = time.perf_counter()
    loss = lm_loss(model(x), y)
    strategy.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    strategy.log(loss=loss)
    times.append(time.perf_counter() - t0)
    turns and turns.give()
    if i + 1 == {warmup} + {steps}:
        break
turns and turns.close()
times = times[{warmup}:]
"""


def median_step(ip, line: str, steps: int, warmup: int, turns: list | None = None) -> float:
    """Run TRAIN_CELL under ``%%distributed {line}``; rank 0's median step time in seconds."""
    import statistics

    ip.run_cell(TRAIN_CELL.format(line=line, steps=steps, warmup=warmup, turns=repr(turns))).raise_error()
    ip.run_line_magic("dist_pull", "times --rank 0")
    return statistics.median(ip.user_ns["times"])
