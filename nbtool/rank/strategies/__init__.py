"""Strategies a ``%%distributed STRATEGY`` cell runs under (engine side).

``install(spec)`` builds the strategy for this rank and puts it in the rank's
namespace as ``strategy``; the cell then calls ``strategy.prepare(...)``.
"""
from __future__ import annotations

import os

from ...metrics import MemorySample, MemoryTimeline, RunDescription, format_bytes
from ...spec import NAMES, TIMELINE_STEPS_DEFAULT, StrategySpec

_last = None  # the strategy of the most recent strategy cell on this rank
_put_back: list = []  # process-wide state the previous strategy had changed and release() restored


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
        _put_back[:] = _last.release() or []
        _last = None
    _last = build(spec)
    if _put_back:
        _last.notes.append("put back what the previous strategy had changed process-wide: " + ", ".join(_put_back))
    if metrics:
        from ..recorder import Recorder

        _last.recorder = Recorder(_last.rank, publish=publish)
        _last.recorder.start()
    if spec.memory_timeline is not None:  # last, so it records the cell and not nbtool's set-up
        from ..memory_timeline import TimelineRecorder

        _last.timeline = TimelineRecorder(_last.rank, _last.device, spec.memory_timeline or None,
                                          int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                          spec.timeline_steps or TIMELINE_STEPS_DEFAULT)
        _last.timeline.start()
    get_ipython().user_ns["strategy"] = _last


def _stop_recorder() -> list:
    records = []
    if _last is not None and _last.compile_clock is not None:
        _last.compile_clock.stop()
    if _last is not None and _last.timeline is not None:
        timeline, _last.timeline = _last.timeline, None
        records.append(timeline.stop())
    if _last is not None and _last.recorder is not None:
        records[:0], _last.recorder = _last.recorder.stop(), None
    _name_workspaces(records)
    return records


def _name_workspaces(records: list) -> None:
    """On CUDA torch's profiler files cuBLAS's workspaces under "unknown": say so, with their size."""
    measured = [r.cuda_workspace for r in records if isinstance(r, MemorySample) and r.cuda_workspace]
    for t in records:
        if measured and isinstance(t, MemoryTimeline) and "unknown" in t.categories:
            said = f"'unknown' holds cuBLAS's workspaces ({format_bytes(measured[-1])}, measured when the run ended)"
            t.note = f"{t.note}; {said}" if t.note else said


def finish(want_summary: bool = True) -> dict:
    """After the cell: stop recording; return this rank's records, summary and description."""
    out = {"records": _stop_recorder(), "summary": None, "description": RunDescription()}
    if _last is not None:
        if want_summary:
            out["summary"] = _last.summary()
        # the line it ran under, even where the cell never prepared a model (the kernel names runs by it)
        out["description"] = RunDescription(spec=_spec_fields(_last.spec))
        if _last.model is not None:
            # plus what the planner needs to predict this run (%dist_plan --vs-last)
            dims = getattr(_last, "dims", None)  # a ParallelDims for tp / pp / fsdp x tp
            out["description"] = RunDescription(
                details=dict(_last.describe()), param_numels=list(_last._param_numels),
                precision=_last.spec.precision, reshard_after_forward=_last.spec.reshard_after_forward,
                dims=tuple(dims) if dims is not None else None, model_shape=dict(_last._model_shape),
                batch=dict(_last.batch_seen), spec=_spec_fields(_last.spec),
                compile=list(_last.compile_clock.events) if _last.compile_clock is not None else [],
                matmul_flops=_cpu_matmul_flops(_last.device))
    return out


def _cpu_matmul_flops(device) -> list | None:
    """On CPU ranks, how fast fp32 and bf16 compute here (measured once per process, after the cell:
    outside its steps' times); None on GPU ranks."""
    if str(device).startswith("cpu"):
        from ..matmul_probe import matmul_flops

        return list(matmul_flops())
    return None


def _spec_fields(spec: StrategySpec) -> dict:
    # as JSON holds them (tuples as lists), so a saved run's description reads back equal
    return {k: list(v) if isinstance(v, tuple) else v for k, v in spec.as_dict().items() if k != "ds_config"}


def checkpoint(action: str, path: str, optimizer: bool = True) -> dict:
    """``%dist_checkpoint save|load PATH``: on the strategy of the last strategy cell."""
    from .base import StrategyError

    if _last is None or _last.model is None:
        raise StrategyError("no prepared strategy on this rank: run a %%distributed STRATEGY cell "
                            "that calls strategy.prepare(model, optimizer) first")
    return _last.save(path) if action == "save" else _last.load(path, optimizer=optimizer)


__all__ = ["NAMES", "StrategySpec", "build", "install", "finish", "checkpoint"]
