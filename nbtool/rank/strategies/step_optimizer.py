"""The optimizer a cell gets back from ``strategy.prepare``: steps at accumulation boundaries only."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import Strategy

class StepOptimizer(torch.optim.Optimizer):
    """The optimizer handed back by prepare(): steps at accumulation boundaries.

    A torch Optimizer (so LR schedulers accept it) that owns no state: param
    groups, state and state dicts are the wrapped optimizer's.
    """

    def __init__(self, strategy: "Strategy", inner):  # no super().__init__: nothing of its own
        self._strategy = strategy
        self.inner = inner
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return getattr(self.inner, "defaults", {})

    def step(self, closure=None):
        return self._strategy._optimizer_step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._strategy.at_boundary:
            self._strategy._zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        return self.inner.load_state_dict(state_dict)

    def __getattr__(self, name):  # anything else the wrapped optimizer offers
        if name in ("inner", "_strategy"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self):
        return f"StepOptimizer({type(self.inner).__name__}, grad_accum={self._strategy.spec.grad_accum})"
