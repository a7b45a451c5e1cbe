"""Strategies a ``%%distributed STRATEGY`` cell runs under (engine side).

``install(spec)`` builds the strategy for this rank and puts it in the rank's
namespace as ``strategy``; the cell then calls ``strategy.prepare(...)``.
"""
from __future__ import annotations

from .spec import NAMES, StrategySpec

_last = None  # the strategy of the most recent strategy cell on this rank


def build(spec: StrategySpec):
    from ..bootstrap import rank_device
    from .ddp import DDPStrategy
    from .fsdp import FSDPStrategy
    from .zero import ZeroStrategy

    if spec.is_mesh:
        from .mesh import MeshStrategy

        return MeshStrategy(spec, rank_device())
    cls = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}.get(spec.name, ZeroStrategy)
    return cls(spec, rank_device())


def install(spec: StrategySpec, metrics: bool = True, publish: bool = True) -> None:
    """Make ``strategy`` in this rank's namespace a fresh strategy for ``spec``.

    With ``metrics`` a Recorder runs until ``finish()``; with ``publish`` it
    also streams records to the kernel while the cell runs (only worth its
    cost when a live dashboard is shown).
    """
    import warnings

    from IPython import get_ipython  # the engine's shell (not display code)

    global _last
    # torch 2.13 deprecates the collective names DeepSpeed and FSDP still call;
    # one warning per call would bury the cell's own output
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # FSDP2 warns whenever a unit returns a view (e.g. a Linear's output); only
    # an in-place op on that output would matter
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    _stop_recorder()
    if _last is not None:  # the previous strategy (and its model) can go before the new one is built
        _last.release()
        _last = None
    _last = build(spec)
    if metrics:
        import torch.distributed as dist

        from ..recorder import Recorder

        _last.recorder = Recorder(dist.get_rank(), publish=publish)
        _last.recorder.start()
    get_ipython().user_ns["strategy"] = _last


def release_deepspeed_state() -> None:
    """Drop what DeepSpeed 0.19 keeps in module globals after a ZeRO-3 run (see ZeroStrategy.release):
    ``PartitionedParameterCoordinator.__params_to_release`` is an unbounded
    ``functools.lru_cache`` on a method (its keys hold ``self`` and the
    modules), and ``parameter_offload.FWD_MODULE_STACK`` keeps the root
    module pushed by the last forward.
    """
    import sys

    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and isinstance(getattr(offload, "FWD_MODULE_STACK", None), list):
        offload.FWD_MODULE_STACK.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
    fn = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
    for _ in range(3):  # DeepSpeed's nvtx wrapper holds the lru_cache in a closure
        if fn is None or hasattr(fn, "cache_clear"):
            break
        cells = dict(zip(getattr(fn, "__code__", None) and fn.__code__.co_freevars or (),
                         (c.cell_contents for c in fn.__closure__ or ())))
        fn = getattr(fn, "__wrapped__", None) or cells.get("func")
    if hasattr(fn, "cache_clear"):
        fn.cache_clear()


def _stop_recorder() -> list:
    if _last is not None and _last.recorder is not None:
        records, _last.recorder = _last.recorder.stop(), None
        return records
    return []


def finish(want_summary: bool = True) -> dict:
    """After the cell: stop recording; return this rank's records, summary and description."""
    out = {"records": _stop_recorder(), "summary": None, "description": {}}
    if _last is not None:
        if want_summary:
            out["summary"] = _last.summary()
        if _last.model is not None:
            # plus what the planner needs to predict this run (%dist_plan --vs-last)
            out["description"] = {**dict(_last.describe()), "param_numels": list(_last._param_numels),
                                  "precision_spec": _last.spec.precision,
                                  "reshard_after_forward": _last.spec.reshard_after_forward}
    return out


def checkpoint(action: str, path: str, optimizer: bool = True) -> dict:
    """``%dist_checkpoint save|load PATH``: on the strategy of the last strategy cell."""
    from .base import StrategyError

    if _last is None or _last.model is None:
        raise StrategyError("no prepared strategy on this rank: run a %%distributed STRATEGY cell "
                            "that calls strategy.prepare(model, optimizer) first")
    return _last.save(path) if action == "save" else _last.load(path, optimizer=optimizer)


__all__ = ["NAMES", "StrategySpec", "build", "install", "finish", "checkpoint"]
