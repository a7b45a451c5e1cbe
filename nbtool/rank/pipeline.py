"""Pipeline parallelism: one stage of the model per rank, micro-batches through a schedule.

The split follows torchtitan's convention. The repeated blocks (the model's
ModuleList) are divided evenly between the stages. Stage 0 also keeps what
comes before the blocks (embeddings), and the last stage keeps what comes
after them (final norm, head). Every other top-level child is set to None, so
the model's forward has to skip parts that are None (``TinyTransformer`` does).
Kept blocks keep their global index, so parameter names match the whole
model's.

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

from .strategies.base import StrategyError
from .tp_plan import block_list


class _KeptBlocks(nn.ModuleList):
    """A ModuleList holding some of the blocks under their global indices ("2", "3" ...).

    Iteration yields the kept blocks in order, and their parameter names
    (``blocks.2.attn...``) stay those of the whole model.
    """

    def __init__(self, kept: dict):
        super().__init__()
        for key, block in kept.items():
            self._modules[key] = block


def split_stage(model: nn.Module, stage: int, stages: int) -> list[str]:
    """Cut ``model`` down, in place, to pipeline stage ``stage`` of ``stages``; return what it kept."""
    prefix, blocks = block_list(model)
    n = len(blocks)
    if n % stages:
        raise StrategyError(f"{n} blocks in {prefix} do not divide into pp({stages}) stages; "
                            f"use a pp that divides {n}, or a model with a multiple of {stages} blocks")
    if "." in prefix:
        raise StrategyError(f"the repeated blocks ({prefix}) must be a top-level child of the model "
                            "for nbtool's pipeline split")
    per = n // stages
    lo, hi = stage * per, (stage + 1) * per
    children = list(model.named_children())
    at = [name for name, _ in children].index(prefix)
    for i, (name, child) in enumerate(children):
        if i == at:
            setattr(model, name, _KeptBlocks({str(j): blocks[j] for j in range(lo, hi)}))
        elif (i < at and stage != 0) or (i > at and stage != stages - 1):
            setattr(model, name, None)
    kept = [f"{name}.{lo}-{hi - 1}" if name == prefix else name for name, _ in model.named_children()]
    return kept


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
