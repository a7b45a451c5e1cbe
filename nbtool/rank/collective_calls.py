"""Which torch.distributed functions are collectives, and what one call moves.

Shared by the metrics recorder (sizes and timing of every call in a strategy
cell) and the hang watchdog (which collective a blocked rank is in).

Two families: the public c10d API (``dist.all_reduce`` ...: DDP's comm hook,
FSDP2, DeepSpeed, pipelining's sends) and the functional collectives in
``torch.distributed._functional_collectives`` that DTensor redistributions use
(tensor and sequence parallelism). The second return a lazily waited tensor;
the wrappers wait for it at once (DTensor does so itself unless asked for an
async redistribute), so a call's time is its completion and a hang shows in it.
"""
from __future__ import annotations

# torch is imported inside the functions: the kernel imports this module (watchdog state
# queries) without needing torch

# public function -> (op, which argument holds the tensor that defines S, how S follows from it)
WRAPPED = {
    "all_reduce": ("all_reduce", 0, "same"),
    "all_reduce_coalesced": ("all_reduce", 0, "list"),
    "reduce": ("reduce", 0, "same"),
    "broadcast": ("broadcast", 0, "same"),
    "all_gather": ("all_gather", 0, "list"),  # output list: total gathered size
    "all_gather_single": ("all_gather", 0, "same"),  # output tensor
    "all_gather_into_tensor": ("all_gather", 0, "same"),
    "_all_gather_base": ("all_gather", 0, "same"),
    "reduce_scatter": ("reduce_scatter", 1, "list"),  # input list: total size
    "reduce_scatter_single": ("reduce_scatter", 1, "same"),  # input tensor
    "reduce_scatter_tensor": ("reduce_scatter", 1, "same"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "same"),
    "all_to_all": ("all_to_all", 1, "list"),
    "all_to_all_single": ("all_to_all", 1, "same"),
    "send": ("send", 0, "same"),
    "isend": ("send", 0, "same"),
    "recv": ("recv", 0, "same"),
    "irecv": ("recv", 0, "same"),
    "barrier": ("barrier", None, "none"),
}

# functional collectives (module torch.distributed._functional_collectives), recorded under
# "funcol.<name>": name -> (op, position of the group argument, S = input bytes x this factor
# ("group": the group size, for gathers whose S is the gathered total))
FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2, "same"),
    "all_gather_single": ("all_gather", 2, "group"),
    "all_gather_tensor": ("all_gather", 2, "group"),
    "reduce_scatter_single": ("reduce_scatter", 3, "same"),
    "reduce_scatter_tensor": ("reduce_scatter", 3, "same"),
    "broadcast": ("broadcast", 2, "same"),
    "all_to_all_single": ("all_to_all", 3, "same"),
}
FUNCTIONAL_PREFIX = "funcol."


def targets():
    """(module, attribute, call name) of every function the watchdog and the recorder wrap."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    for name in WRAPPED:
        for module in (dist, c10d):
            if getattr(module, name, None) is not None:
                yield module, name, name
    for name in FUNCTIONAL:
        if getattr(funcol, name, None) is not None:
            yield funcol, name, FUNCTIONAL_PREFIX + name


def complete(name: str, result):
    """Wait for a functional collective's lazily waited result (no-op for the c10d API)."""
    if name.startswith(FUNCTIONAL_PREFIX) and hasattr(result, "trigger_wait"):
        result.trigger_wait()
    return result


# keyword names of the S-defining argument, by (position, kind)
_KEYWORDS = {
    (0, "same"): ("tensor", "output_tensor", "output"),
    (0, "list"): ("tensor_list", "output_tensor_list", "tensors"),
    (1, "same"): ("input_tensor", "input", "tensor"),
    (1, "list"): ("input_list", "input_tensor_list"),
}


def is_async(name: str, kwargs: dict) -> bool:
    return bool(kwargs.get("async_op", False)) or name in ("isend", "irecv")


def describe_call(name: str, args: tuple, kwargs: dict) -> tuple[str, int, int, str]:
    """(op, size S in bytes, group size, dtype) of one call; never raises.

    On every recorded collective's path (ZeRO-3 issues ~100 a step), so it
    avoids torch.distributed's checked lookups: ``group.size()`` directly,
    the world size looked up once, dtype names cached.
    """
    if name.startswith(FUNCTIONAL_PREFIX):
        return _describe_functional(name[len(FUNCTIONAL_PREFIX):], args, kwargs)
    op, arg, how = WRAPPED[name]
    try:
        group = kwargs.get("group")
        n = group.size() if group is not None else _world_size()
        tensor = (None if arg is None else args[arg] if len(args) > arg
                  else next((kwargs[k] for k in _KEYWORDS[(arg, how)] if k in kwargs), None))
        return op, nbytes(tensor), n, dtype_name(tensor)
    except Exception:  # an unusual call signature: what is known, never break the call
        try:
            return op, 0, _world_size(), ""
        except Exception:
            return op, 0, 0, ""


_world: list = []  # (the default process group, its size): one group per engine life, checked by identity


def _world_size() -> int:
    import torch.distributed.distributed_c10d as c10d

    pg = c10d._world.default_pg
    if not _world or _world[0][0] is not pg:
        import torch.distributed as dist

        _world[:] = [(pg, dist.get_world_size())]
    return _world[0][1]


def _describe_functional(name: str, args: tuple, kwargs: dict) -> tuple[str, int, int, str]:
    op, group_at, how = FUNCTIONAL[name]
    try:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        tensor = args[0] if args else kwargs.get("self")
        group = args[group_at] if len(args) > group_at else kwargs.get("group")
        n = c10d._get_group_size_by_name(funcol._resolve_group_name(group, kwargs.get("tag", "")))
        return op, nbytes(tensor) * (n if how == "group" else 1), n, dtype_name(tensor)
    except Exception:  # never break the call for a description
        return op, 0, 0, ""


def nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    try:
        return t.numel() * t.element_size()
    except AttributeError:  # not a tensor
        return 0


_DTYPE_NAMES: dict = {}


def dtype_name(t) -> str:
    if isinstance(t, (list, tuple)):
        return dtype_name(t[0]) if t else ""
    dtype = getattr(t, "dtype", None)
    if dtype is None:
        return ""
    return _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype).replace("torch.", ""))
