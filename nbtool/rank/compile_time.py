"""``--compile``: which modules torch.compile wraps, and the seconds it spends compiling.

Compilation runs inside the first step (and again wherever dynamo recompiles),
so a compiled run's step times would carry it; ``CompileClock`` times it from
dynamo's own start and end callbacks, per step, so the run's summary reports
it apart and leaves the steps that compiled out of its step time.
"""
from __future__ import annotations

import contextlib
import time

from torch import nn


def compile_blocks(model: nn.Module) -> list[str]:
    """``module.compile()`` (in place: the state dict keeps its keys) on each repeated block,
    torchtitan's per-block compile: it composes with per-block FSDP units and pipeline stages,
    and the embeddings and head stay eager. Returns the compiled modules' names."""
    from .model_adapters import block_classes

    names = block_classes(model)
    done = []
    for qualname, module in model.named_modules():
        if module is not model and type(module).__name__ in names:
            module.compile()
            done.append(qualname)
    return done


class CompileClock:
    """Wall seconds dynamo spends compiling, as [step, seconds] per optimizer step it fell in.

    Dynamo calls the start callback when the first of any concurrent compilations
    starts and the end callback when the last ends, so intervals never overlap.
    """

    def __init__(self, steps_done):
        self.events: list[list] = []
        self._steps_done, self._t0 = steps_done, None

    def start(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._begin)
        callback_handler.register_end_callback(self._end)

    def stop(self) -> None:
        from torch._dynamo.callback import callback_handler

        for remove, fn in ((callback_handler.remove_start_callback, self._begin),
                           (callback_handler.remove_end_callback, self._end)):
            with contextlib.suppress(ValueError):  # already removed
                remove(fn)

    def _begin(self, args) -> None:
        self._t0, self._step = time.perf_counter(), self._steps_done() + 1

    def _end(self, args) -> None:
        if self._t0 is None:
            return
        seconds, self._t0 = time.perf_counter() - self._t0, None
        if self.events and self.events[-1][0] == self._step:  # one entry per step (graph breaks compile many)
            self.events[-1][1] += seconds
        else:
            self.events.append([self._step, seconds])
