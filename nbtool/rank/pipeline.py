"""Pipeline parallelism: one stage of the model per rank (or several), micro-batches through a schedule.

The split follows torchtitan's convention. The repeated blocks (the model's
ModuleList) are divided evenly between the stages. Stage 0 also keeps what
comes before the blocks (embeddings), and the last stage keeps what comes
after them (final norm, head); the other parts are set to None. Where the
blocks sit and how a stage runs (the model's own forward skipping None
parts, or nbtool's stage of a Hugging Face / nanoGPT-style decoder, checked
against the model's forward first) is nbtool.rank.model_adapters'. Kept
blocks keep their global index, so parameter names match the whole model's.

Schedules come from ``torch.distributed.pipelining`` (GPipe: all forwards,
then all backwards; 1F1B: one forward one backward in the steady state,
fewer activations alive). With equal stages both leave each stage idle for
(pp - 1) / (M + pp - 1) of a step, the bubble. The interleaved and
zero-bubble schedules run several stages per rank (spec.stage_indices): the
model then keeps the union of the rank's parts, and each stage runs a view
of it (``stage_view``); spec.bubble_fraction has each schedule's theory. ``StageClock`` measures how
long the stage actually computes, so the bubble shown is measured, not
assumed; it also holds the sends and receives (on CPU ranks a gloo round
trip costs about as much as a small layer) and any imbalance of the stages.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from . import model_adapters
from .strategies.base import StrategyError


def split_stages(model: nn.Module, mine: list[int], stages: int, layout: str) -> tuple[list, list[str], list]:
    """Cut ``model`` down, in place, to the blocks of this rank's stages ``mine`` (of ``stages``).

    ``model`` keeps the union of this rank's parts (its parameters, state dict and optimizer are
    this rank's). Returns the module the schedule runs for each stage in ``mine`` (with one stage,
    the model itself for the ``toplevel`` shape, else a StageModule around it; with several, a view
    per stage: shallow copies of the modules from the root to the blocks' owner, sharing every
    other module and parameter with ``model``), the parts kept, and the weights tied across stages
    (see ``tied_across_stages``). ``layout`` names the split in messages.
    """
    shape = model_adapters.decoder(model)
    blocks = shape.blocks
    prefix = shape.qualified(shape.trunk, shape.blocks_attr)
    n = len(blocks)
    if n % stages:
        raise StrategyError(f"{n} blocks in {prefix} do not divide into {layout}; use a number of stages that "
                            f"divides {n}, or a model with a multiple of {stages} blocks")
    model_adapters.check_stages(model, shape)  # before anything is cut
    per = n // stages
    first, last = 0 in mine, stages - 1 in mine
    tied = tied_across_stages(model, shape, stages, per)
    own = {s: {k: blocks[int(k)] for k in stage_block_keys(s, per)} for s in mine}
    views = [stage_view(model, shape, own[s], s == 0, s == stages - 1) for s in mine] if len(mine) > 1 else None
    setattr(shape.trunk, shape.blocks_attr, model_adapters.KeptBlocks(
        {k: b for s in sorted(mine) for k, b in own[s].items()}))
    kept = [shape.qualified(o, a) for o, a in shape.before] if first else []
    kept += [f"{prefix}.{s * per}-{(s + 1) * per - 1}" for s in sorted(mine)]
    kept += [shape.qualified(o, a) for o, a in shape.after] if last else []
    for owner, attr in (() if first else shape.before) + (() if last else shape.after):
        setattr(owner, attr, None)
    if views is not None:
        return views, kept, tied
    run = model if shape.kind == "toplevel" else model_adapters.StageModule(model, shape, first, last)
    return [run], kept, tied


def stage_block_keys(stage: int, per: int) -> list[str]:
    """The keys (global indices) of stage ``stage``'s blocks, ``per`` blocks a stage, in order."""
    return [str(j) for j in range(stage * per, (stage + 1) * per)]


def stage_view(model: nn.Module, shape, blocks: dict, first: bool, last: bool) -> nn.Module:
    """One stage of several on a rank: the model's modules from the root to the blocks' owner copied
    shallowly (their own child tables), holding ``blocks`` and, on the first and last stages, the
    parts before and after them; every other module and parameter is ``model``'s own, so the
    stages' gradients land on the same parameters (a tied weight held twice is one tensor)."""
    def shallow(m):
        c = copy.copy(m)
        c._modules = dict(m._modules)
        return c

    root = shallow(model)
    copies = {id(model): root}
    owner, orig = root, model
    for name in shape.trunk_name.split(".") if shape.trunk_name else ():
        orig = orig._modules[name]
        owner._modules[name] = owner = copies[id(orig)] = shallow(orig)
    owner._modules[shape.blocks_attr] = model_adapters.KeptBlocks(blocks)
    for o, a in (() if first else shape.before) + (() if last else shape.after):
        copies[id(o)]._modules[a] = None
    if shape.kind == "toplevel":
        return root
    view = model_adapters.Decoder(
        shape.kind, shape.trunk_name, copies[id(shape.trunk)], shape.blocks_attr,
        tuple((copies[id(o)], a) for o, a in shape.before), tuple((copies[id(o)], a) for o, a in shape.after),
        copies.get(id(shape.head_owner)))
    return model_adapters.StageModule(root, view, first, last)


def tied_across_stages(model: nn.Module, shape, stages: int, per: int) -> list:
    """[(names, empty tensor like it)] for each parameter whose names fall on different stages
    (GPT-2's lm_head.weight is transformer.wte.weight): each stage keeps a copy, and their gradients
    are summed over the pipeline before each step, as Megatron does for tied embeddings."""
    prefix = shape.qualified(shape.trunk, shape.blocks_attr)
    edges = [(shape.qualified(o, a), 0) for o, a in shape.before] + \
            [(shape.qualified(o, a), stages - 1) for o, a in shape.after]

    def stage_of(name):
        if name.startswith(prefix + "."):
            return int(name[len(prefix) + 1:].split(".")[0]) // per
        return next((s for part, s in edges if name.startswith(part + ".")), None)

    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    return [(aliases, torch.empty_like(p, device="meta")) for p, aliases in names.values()
            if len({stage_of(n) for n in aliases} - {None}) > 1]


class StageClock:
    """Seconds the stage computes: its forward and backward chunks, the loss (last stage) and the
    gradient scaling. The rest of a step is the bubble: waiting, sends and receives, scheduling."""

    def __init__(self, stages):
        self.compute_s = 0.0
        for stage in stages:
            self._wrap(stage, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "scale_grads"))

    def watch_schedule(self, schedule) -> None:
        self._wrap(schedule, ("_maybe_compute_loss",))

    def _wrap(self, obj, methods) -> None:
        for method in methods:
            fn = getattr(obj, method, None)
            if fn is not None:
                setattr(obj, method, self._timed(fn))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - t0

        return timed


def build_schedule(runs: list, mine: list[int], stages: int, device, group, schedule: str,
                   microbatches: int, loss_fn):
    """The PipelineStages of this rank and their schedule, plus the clock timing their compute.

    With several stages per rank the schedule leaves the gradients unscaled (scale_grads=False):
    it would divide per stage, twice for a weight two of this rank's stages share; the strategy
    divides each parameter's once (``scale_once``).
    """
    from torch.distributed import pipelining as pl

    pipe_stages = [pl.PipelineStage(run, s, stages, device, group=group) for run, s in zip(runs, mine)]
    clock = StageClock(pipe_stages)
    if len(pipe_stages) == 1:
        cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}[schedule]
        sched = cls(pipe_stages[0], microbatches, loss_fn=loss_fn)
    else:
        cls = {"interleaved-1f1b": pl.ScheduleInterleaved1F1B, "interleaved-zb": pl.ScheduleInterleavedZeroBubble,
               "zbv": pl.ScheduleZBVZeroBubble}[schedule]
        sched = cls(pipe_stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    clock.watch_schedule(sched)
    return sched, clock


@torch.no_grad()
def scale_once(model: nn.Module, microbatches: int) -> None:
    """The mean over the micro-batches: each gradient (summed over them) divided once."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(microbatches)


def check_batch(inputs, microbatches: int) -> None:
    size = inputs.shape[0] if torch.is_tensor(inputs) else None
    if size is not None and size % microbatches:
        raise StrategyError(f"a batch of {size} samples does not split into {microbatches} micro-batches; "
                            f"use a batch size divisible by {microbatches} (or --microbatches)")
