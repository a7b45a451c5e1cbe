"""DDP: a full replica per rank; gradients all-reduced in buckets during backward."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Autocast(nn.Module):
    """Runs the wrapped module's forward under torch.autocast (mixed precision, fp32 weights)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class DDPStrategy(Strategy):
    name = "ddp"

    def _wrap(self, model, optimizer):
        self._plain = model.to(self.device)
        inner = self._plain
        if self.spec.precision in DTYPES:
            inner = Autocast(inner, self.device.type, DTYPES[self.spec.precision])
        kwargs = {"bucket_cap_mb": self.spec.bucket_mb} if self.spec.bucket_mb is not None else {}
        self._ddp = DistributedDataParallel(
            inner,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=None,  # the world
            gradient_as_bucket_view=self.spec.grad_as_bucket_view,
            static_graph=self.spec.static_graph,
            **kwargs,
        )
        self._python_hook = self.recorder is not None or self.spec.compress is not None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook, state = self._compression_hook()
        if hook is not None:  # Python hooks call dist.all_reduce: the recorder sees the compressed bytes
            self._ddp.register_comm_hook(state, hook)
        elif self._python_hook:
            # the built-in C++ all-reduce is invisible from Python; this hook does the
            # same maths (divide by world size, sum) through dist.all_reduce
            self._ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # state None: the world
        if self.spec.compile:  # DDP's documented order: wrap, then compile (DDPOptimizer splits at buckets)
            self._ddp.compile()
            self.compiled = ["the DDP-wrapped model (its graph split at the gradient buckets by DDPOptimizer)"]
        self._scaler = torch.amp.GradScaler(self.device.type) if self.spec.precision == "fp16" else None
        return self._ddp, optimizer

    def _compression_hook(self):
        """(hook, state) for --compress, or (None, None)."""
        from ...spec import compression

        chosen = compression(self.spec)
        if chosen is None:
            return None, None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        kind, rank, start = chosen
        if kind in ("fp16", "bf16"):
            return getattr(default_hooks, f"{kind}_compress_hook"), None
        # error feedback and warm start (PowerSGD's defaults); vanilla all-reduce before step `start`
        self._powersgd = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                     start_powerSGD_iter=start, random_seed=self.spec.seed)
        return powerSGD_hook.powerSGD_hook, self._powersgd

    def _set_gradient_sync(self, sync: bool) -> None:
        # what DDP.no_sync() toggles; read at forward time, so set it ahead
        self._ddp.require_backward_grad_sync = sync

    def _backward(self, loss):
        loss = loss / self.spec.grad_accum
        (self._scaler.scale(loss) if self._scaler else loss).backward()

    def _step(self, closure=None):
        if self._scaler is None:
            return super()._step(closure)
        self._scaler.unscale_(self.optimizer.inner)  # clip the true gradients
        self._clip()
        out = self._scaler.step(self.optimizer.inner)
        self._scaler.update()
        return out

    def _full_state_dict(self):
        return self._plain.state_dict()

    def model_state(self, for_load: bool = False) -> dict:
        return self._plain.state_dict()  # full tensors that share storage with the parameters

    @torch.no_grad()
    def apply_model_state(self, sd: dict) -> None:
        self._plain.load_state_dict(sd)

    def _describe(self):
        d = super()._describe()
        d["wrapper"] = "torch.nn.parallel.DistributedDataParallel" + (
            f" over Autocast({self.spec.precision})" if self.spec.precision in DTYPES else "")
        d["sharding"] = "none (full replica per rank)"
        d["bucket_cap_mb"] = self.spec.bucket_mb if self.spec.bucket_mb is not None else "25 (DDP default)"
        d["gradient_as_bucket_view"] = self.spec.grad_as_bucket_view
        d["static_graph"] = self.spec.static_graph
        d["comm_hook"] = ("default_hooks.allreduce_hook (Python, so each bucket's all-reduce is recorded)"
                          if getattr(self, "_python_hook", False) else "built-in (C++)")
        if self.spec.compress:
            from ...spec import compression

            kind, rank, start = compression(self.spec)
            d["comm_hook"] = (f"default_hooks.{kind}_compress_hook (gradients all-reduced in {kind})"
                              if kind in ("fp16", "bf16") else f"powerSGD_hook (rank {rank}, error feedback, warm "
                              f"start; vanilla all-reduce before step {start})")
            if kind == "powersgd" and self.model is not None:
                before, after = powersgd_elements([tuple(p.shape) for p in self._plain.parameters()], rank)
                d["powersgd_elements"] = {"before": before, "after": after}
        if self.spec.precision == "bf16":
            d["mixed_precision"] = "torch.autocast bf16 forward; fp32 weights, grads, all-reduce"
        elif self.spec.precision == "fp16":
            d["mixed_precision"] = "torch.autocast fp16 forward with torch.amp.GradScaler"
        return d


def powersgd_elements(shapes: list[tuple], rank: int, min_rate: float = 2.0) -> tuple[int, int]:
    """(gradient elements, elements PowerSGD all-reduces per step): a tensor viewed as n x m is sent
    as P (n x r) and Q (m x r), r = min(n, m, rank), when (n + m) r x min_rate < n m; whole otherwise
    (powerSGD_hook's own rule)."""
    before = after = 0
    for shape in shapes:
        n, numel = (shape[0] if shape else 1), math.prod(shape)
        m = numel // n if n else 0
        r = min(n, m, rank)
        before += numel
        after += (n + m) * r if (n + m) * r * min_rate < n * m else numel
    return before, after
