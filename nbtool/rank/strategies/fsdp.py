"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded per unit.

Each wrapped module is one unit: its parameters are all-gathered before its
forward (and again before backward when resharded) and its gradients are
reduce-scattered after backward. The root is wrapped last and owns every
parameter not in a wrapped unit.
"""
from __future__ import annotations

import torch

from ...spec import hsdp_dims
from ..groups import hsdp_mesh, world_mesh
from .base import Strategy, StrategyError, param_names, repoint_optimizer
from .ledger import Tally



def shard_units(model, mesh, spec, replicate_mesh=None, root=None) -> tuple[list[str], list[str]]:
    """fully_shard the modules of the --wrap classes (innermost first), then the root; the names of
    the units, and of the modules kept whole (--replicate, on ``replicate_mesh``). ``root``: the
    module whose forward runs the model, where that is not ``model`` (a pipeline stage of a Hugging
    Face model: nbtool.rank.model_adapters.StageModule); its hooks gather the parameters no unit holds.

    Without --wrap the repeated blocks are the units (accelerate's transformer
    auto-wrap, torchtitan's choice): a Hugging Face model's ``_no_split_modules``
    classes, else the class its ModuleLists repeat. Each block's parameters are
    then gathered only around its own forward and backward; one unit for the
    whole model would gather everything at once and save no memory while it
    runs. ``--wrap none`` keeps that single unit.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    wrap = set(spec.wrap)
    if not wrap:
        from ..model_adapters import block_classes

        wrap = block_classes(model)
    wrap.discard("none")
    whole = set(spec.replicate)
    wrap -= whole
    if type(model).__name__ in whole:
        raise StrategyError(f"--replicate {type(model).__name__} names the model itself; replicating the whole "
                            "model is ddp: use %%distributed ddp, or name the parts to keep whole")
    units, replicated = [], []
    for qualname, module in reversed(list(model.named_modules())):
        if module is model:
            continue
        if type(module).__name__ in whole:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=replicate_mesh, **{k: v for k, v in kwargs.items()
                                                      if k in ("mp_policy", "offload_policy")})
            replicated.append(qualname)
        elif type(module).__name__ in wrap:
            fully_shard(module, **kwargs)
            units.append(qualname)
    fully_shard(root or model, **kwargs)
    units.append("<root>")
    return units, replicated


class FSDPStrategy(Strategy):
    name = "fsdp"

    def _wrap(self, model, optimizer):
        groups = param_names(model, optimizer)
        if not self.spec.offload:
            model.to(self.device)
        if self.spec.compile:  # per block, before fully_shard (torchtitan's order)
            from ..compile_time import compile_blocks

            self.compiled = compile_blocks(model)
        kind = self.device.type
        self.hsdp = hsdp_dims(self.spec, self.world_size)
        mesh = hsdp_mesh(kind, *self.hsdp) if self.hsdp else world_mesh(kind)
        modules = dict(model.named_modules())
        self.units, self.replicated = shard_units(model, mesh, self.spec, world_mesh(kind))
        self._replicated_elements = sum(p.numel() for name in self.replicated
                                        for p in modules[name].parameters())
        self._plain = model
        repoint_optimizer(optimizer, model, groups)
        self.notes.append("optimizer param_groups re-pointed at the sharded (DTensor) parameters")
        return model, optimizer

    def _set_gradient_sync(self, sync: bool) -> None:
        self._plain.set_requires_gradient_sync(sync)

    def _tally(self, tally: Tally) -> None:
        super()._tally(tally, offloaded=bool(self.spec.offload))

    def _full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self._plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _describe(self):
        d = super()._describe()
        d["wrapper"] = "torch.distributed.fsdp.fully_shard (FSDP2)"
        over = (f"HSDP: sharded over dp_shard({self.hsdp[1]}), replicated over dp_replicate({self.hsdp[0]})"
                if getattr(self, "hsdp", None) else f"over {self.world_size} ranks")
        d["sharding"] = (f"{len(self.units)} unit(s) {over}, "
                         f"reshard_after_forward={self.spec.reshard_after_forward} "
                         f"({'ZeRO-3-like' if self.spec.reshard_after_forward else 'ZeRO-2-like'})")
        d["units"] = list(getattr(self, "units", []))
        if getattr(self, "replicated", None):
            d["replicated"] = [f"{name} (whole on every rank, gradients all-reduced)" for name in self.replicated]
            d["replicated_elements"] = self._replicated_elements
        if self.spec.precision == "bf16":
            d["mixed_precision"] = "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); fp32 sharded weights"
        d["offload"] = "CPUOffloadPolicy (params, grads, optimizer state on host)" if self.spec.offload else None
        return d
