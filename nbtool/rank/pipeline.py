"""Pipeline parallelism: one stage of the model per rank, micro-batches through a schedule.

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
(pp - 1) / (M + pp - 1) of a step, the bubble. ``StageClock`` measures how
long the stage actually computes, so the bubble shown is measured, not
assumed; it also holds the sends and receives (on CPU ranks a gloo round
trip costs about as much as a small layer) and any imbalance of the stages.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from . import model_adapters
from .strategies.base import StrategyError


def split_stage(model: nn.Module, stage: int, stages: int) -> tuple[nn.Module, list[str], list]:
    """Cut ``model`` down, in place, to pipeline stage ``stage`` of ``stages``.

    Returns the module the schedule runs for this stage (the model itself for
    the ``toplevel`` shape, else a StageModule around it), the parts kept,
    and the weights tied across stages (see ``tied_across_stages``).
    """
    shape = model_adapters.decoder(model)
    blocks = shape.blocks
    prefix = shape.qualified(shape.trunk, shape.blocks_attr)
    n = len(blocks)
    if n % stages:
        raise StrategyError(f"{n} blocks in {prefix} do not divide into pp({stages}) stages; "
                            f"use a pp that divides {n}, or a model with a multiple of {stages} blocks")
    model_adapters.check_stages(model, shape)  # before anything is cut
    per = n // stages
    lo, hi = stage * per, (stage + 1) * per
    first, last = stage == 0, stage == stages - 1
    tied = tied_across_stages(model, shape, stages, per)
    setattr(shape.trunk, shape.blocks_attr, model_adapters.KeptBlocks({str(j): blocks[j] for j in range(lo, hi)}))
    kept = [shape.qualified(o, a) for o, a in shape.before] if first else []
    kept.append(f"{prefix}.{lo}-{hi - 1}")
    kept += [shape.qualified(o, a) for o, a in shape.after] if last else []
    for owner, attr in (() if first else shape.before) + (() if last else shape.after):
        setattr(owner, attr, None)
    run = model if shape.kind == "toplevel" else model_adapters.StageModule(model, shape, first, last)
    return run, kept, tied


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
    out = []
    for p, aliases in names.values():
        held = {stage_of(n) for n in aliases} - {None}
        if len(held) > 1:
            out.append((aliases, torch.empty_like(p, device="meta")))
    return out


class StageClock:
    """Seconds the stage computes: its forward and backward chunks, the loss (last stage) and the
    gradient scaling. The rest of a step is the bubble: waiting, sends and receives, scheduling."""

    def __init__(self, stage):
        self.compute_s = 0.0
        self._wrap(stage, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                           "scale_grads"))

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


def build_schedule(stage_model: nn.Module, stage: int, stages: int, device, group, schedule: str,
                   microbatches: int, loss_fn):
    """The PipelineStage for this rank and its schedule, plus the clock timing its compute."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipe_stage = PipelineStage(stage_model, stage, stages, device, group=group)
    clock = StageClock(pipe_stage)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(pipe_stage, microbatches, loss_fn=loss_fn)
    clock.watch_schedule(sched)
    return sched, clock


def check_batch(inputs, microbatches: int) -> None:
    size = inputs.shape[0] if torch.is_tensor(inputs) else None
    if size is not None and size % microbatches:
        raise StrategyError(f"a batch of {size} samples does not split into {microbatches} micro-batches; "
                            f"use a batch size divisible by {microbatches} (or --microbatches)")
