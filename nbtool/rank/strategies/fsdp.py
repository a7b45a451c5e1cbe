"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded per unit.

Each wrapped module is one unit: its parameters are all-gathered before its
forward (and again before backward when resharded) and its gradients are
reduce-scattered after backward. The root is wrapped last and owns every
parameter not in a wrapped unit.
"""
from __future__ import annotations

import torch

from .base import Strategy, StrategyError, Tally

_meshes: dict = {}


def world_mesh(device_type: str):
    """One 1-D mesh over the world per engine life (it reuses the default group)."""
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed as dist

    if device_type not in _meshes:
        _meshes[device_type] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _meshes[device_type]


class FSDPStrategy(Strategy):
    name = "fsdp"

    def _wrap(self, model, optimizer):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": world_mesh(self.device.type),
                  "reshard_after_forward": self.spec.reshard_after_forward}
        if self.spec.precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.spec.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        else:
            model.to(self.device)
        names = {id(p): n for n, p in model.named_parameters()}
        try:
            groups = [{"params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        except KeyError:
            raise StrategyError("the optimizer holds tensors that are not parameters of this model; "
                                "create it from model.parameters()") from None
        self.units = []
        wrap = set(self.spec.wrap)
        # innermost first, so nested wrapped classes become their own units
        for qualname, module in reversed(list(model.named_modules())):
            if module is not model and type(module).__name__ in wrap:
                fully_shard(module, **kwargs)
                self.units.append(qualname)
        fully_shard(model, **kwargs)
        self.units.append("<root>")
        self._plain = model
        # fully_shard replaced the parameters with DTensors: point the (still empty)
        # optimizer at them, in place, so the user's optimizer object stays valid
        params = dict(model.named_parameters())
        try:
            for g, named in zip(optimizer.param_groups, groups):
                g["params"] = [params[n] for n in named["params"]]
        except KeyError as e:
            raise StrategyError(f"optimizer parameter {e} is not a parameter of the model") from None
        self.notes.append("optimizer param_groups re-pointed at the sharded (DTensor) parameters")
        self._set_gradient_sync(self.spec.grad_accum == 1)
        return model, optimizer

    def _set_gradient_sync(self, sync: bool) -> None:
        self._plain.set_requires_gradient_sync(sync)

    def _tally(self, tally: Tally) -> None:
        off = bool(self.spec.offload)
        for p in self._plain.parameters():
            tally.add("params", p, off)
        for p in self._plain.parameters():
            tally.add("grads", p.grad, off)
        tally.add_optimizer_state(self.optimizer.inner.state, off)

    def _full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self._plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _describe(self):
        d = super()._describe()
        d["wrapper"] = "torch.distributed.fsdp.fully_shard (FSDP2)"
        d["sharding"] = (f"{len(self.units)} unit(s) over {self.world_size} ranks, "
                         f"reshard_after_forward={self.spec.reshard_after_forward} "
                         f"({'ZeRO-3-like' if self.spec.reshard_after_forward else 'ZeRO-2-like'})")
        d["units"] = list(getattr(self, "units", []))
        if self.spec.precision == "bf16":
            d["mixed_precision"] = "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); fp32 sharded weights"
        d["offload"] = "CPUOffloadPolicy (params, grads, optimizer state on host)" if self.spec.offload else None
        return d
