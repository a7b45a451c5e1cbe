"""Engine side: torch's process-wide functions, hooks and modes, as a strategy found them.

Strategies (DeepSpeed above all) patch process-wide state: ZeRO-3's
``zero.Init`` replaces ``torch.nn.functional.linear`` with its memory-efficient
``zero3_linear_wrap`` "until manually reset", so every later cell's
``nn.Linear`` ran through it under any strategy. A strategy takes a snapshot
when it is built and puts back, when the next strategy cell replaces it,
whatever differs: the functions of ``torch.nn.functional`` and torch's tensor
factories, ``nn.Module`` methods, the global module hooks, grad mode, the
default dtype and autocast. What was put back is returned, to be said.
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _module

FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "tensor", "arange", "empty_like",
             "zeros_like", "ones_like", "full_like", "empty_strided", "as_tensor")
MODULE_METHODS = ("__init__", "apply", "register_parameter", "__setattr__", "__getattr__", "_apply")
GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                "_global_backward_hooks", "_global_module_registration_hooks",
                "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def _functions() -> dict:
    F = torch.nn.functional
    out = {(F, n): getattr(F, n) for n in dir(F) if not n.startswith("_") and callable(getattr(F, n))}
    out.update({(torch, n): getattr(torch, n) for n in FACTORIES if hasattr(torch, n)})
    out.update({(torch.nn.Module, n): torch.nn.Module.__dict__[n] for n in MODULE_METHODS
                if n in torch.nn.Module.__dict__})
    return out


def snapshot() -> dict:
    return {
        "functions": _functions(),
        "hooks": {n: dict(getattr(_module, n)) for n in GLOBAL_HOOKS if hasattr(_module, n)},
        "grad": torch.is_grad_enabled(),
        "dtype": torch.get_default_dtype(),
        "autocast": {d: torch.is_autocast_enabled(d) for d in ("cpu", "cuda")},
    }


def restore(snap: dict) -> list[str]:
    """Put back what differs from ``snap``; the names of what was put back."""
    put_back = []
    now = _functions()
    for (owner, name), original in snap["functions"].items():
        if now.get((owner, name)) is not original:
            setattr(owner, name, original)
            put_back.append(f"{getattr(owner, '__name__', owner)}.{name}")
    for name, hooks in snap["hooks"].items():
        current = getattr(_module, name)
        if dict(current) != hooks:
            current.clear()
            current.update(hooks)
            put_back.append(f"torch.nn.modules.module.{name}")
    if torch.is_grad_enabled() != snap["grad"]:
        torch.set_grad_enabled(snap["grad"])
        put_back.append("grad mode")
    if torch.get_default_dtype() != snap["dtype"]:
        torch.set_default_dtype(snap["dtype"])
        put_back.append("default dtype")
    for device, enabled in snap["autocast"].items():
        if torch.is_autocast_enabled(device) != enabled:
            torch.set_autocast_enabled(device, enabled)
            put_back.append(f"autocast ({device})")
    return put_back
