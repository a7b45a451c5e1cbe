"""Portable, atomic checkpoints of a strategy's model and optimizer (engine side).

Layout of a checkpoint directory ``PATH``::

    PATH/latest                 {"dir": "ckpt-000012-ab12cd34"}  (switched last, atomically)
    PATH/ckpt-000012-ab12cd34/
        meta.json               strategy, world size, pipeline split, steps, parameter names
        model/                  torch.distributed.checkpoint (DCP) of the model state dict
        optim/                  DCP of the optimizer (ddp, fsdp, tp, pp)
        deepspeed/              DeepSpeed's own checkpoint (zero1-3: optimizer partitions)

What each strategy holds and how it is read and written (``model_state``,
``apply_model_state``, ``save_optimizer``, ``load_optimizer``) belongs to the
strategy; this module keeps the directory protocol.

The model is saved under the plain model's parameter names, as full tensors
(ddp, zero1-3) or DTensor shards (fsdp); DCP reshards on load, so weights
saved under one strategy load under any other, at any world size. The
optimizer state is restored only under the strategy, world size and
pipeline split (pp x stages a rank) that saved it (each shards it
differently: a stage's optimizer holds its own parameters only, and fsdp's
whole-model state had failed to load into fsdp --pp's).

Atomic: every rank writes into a fresh ``ckpt-*`` directory; only when all
have finished (a barrier) does rank 0 write ``meta.json`` and switch
``latest`` with ``os.replace``. A crash before that leaves ``latest``
pointing at the previous checkpoint; the partial directory is removed by
the next successful save.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..checkpoint_layout import FORMAT, CheckpointError, atomic_write, latest_dir, read_meta


def save(strategy, path: str) -> dict:
    """Write model + optimizer state of ``strategy`` to ``path`` (a collective: every rank calls it)."""
    if strategy.model is None:
        raise CheckpointError("call strategy.prepare(model, optimizer) before saving a checkpoint")
    path = os.path.abspath(path)
    name = [f"ckpt-{strategy.steps:06d}-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)  # one directory name for every rank
    target = os.path.join(path, name[0])
    if dist.get_rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    model_sd = strategy.model_state(for_load=False)
    dcp.save(model_sd, checkpoint_id=os.path.join(target, "model"))
    strategy.save_optimizer(target)
    dist.barrier()  # every rank's files are complete
    names = [None] * dist.get_world_size()  # pipeline stages each hold part of the model
    dist.all_gather_object(names, sorted(model_sd))
    meta = {"format": FORMAT, "strategy": strategy.name, "precision": strategy.spec.precision,
            "world_size": strategy.world_size, "pipeline": _pipeline(strategy), "steps": strategy.steps,
            "time": time.time(),
            "params": sorted(set().union(*names))}
    if dist.get_rank() == 0:
        with open(os.path.join(target, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        atomic_write(os.path.join(path, "latest"), json.dumps({"dir": name[0]}))
        for old in os.listdir(path):  # older checkpoints and partial ones from crashed saves
            if old.startswith("ckpt-") and old != name[0]:
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    dist.barrier()
    return {"path": path, "dir": name[0], "steps": strategy.steps, "seconds": time.perf_counter() - t0,
            "bytes": _dir_bytes(target) if dist.get_rank() == 0 else None}


def load(strategy, path: str, optimizer: bool = True) -> dict:
    """Load the latest complete checkpoint in ``path`` into ``strategy``'s model (and optimizer)."""
    if strategy.model is None:
        raise CheckpointError("call strategy.prepare(model, optimizer) before loading a checkpoint")
    path = os.path.abspath(path)
    meta = read_meta(path)
    d = latest_dir(path)
    sd = strategy.model_state(for_load=True)
    missing = sorted(set(sd) - set(meta["params"]))
    # a pipeline stage loads its own part; any other model must match the checkpoint whole
    unexpected = [] if getattr(strategy, "pp", 1) > 1 else sorted(set(meta["params"]) - set(sd))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path!r} does not match this model: " + "; ".join(
            f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", unexpected)) if names))
    dcp.load(sd, checkpoint_id=os.path.join(d, "model"))
    strategy.apply_model_state(sd)
    same = (meta["strategy"] == strategy.name and meta["world_size"] == strategy.world_size
            and meta.get("pipeline", [1, 1]) == _pipeline(strategy))
    restored_optimizer = optimizer and same
    if restored_optimizer:
        strategy.load_optimizer(d)
    strategy.resume_at(meta["steps"])
    dist.barrier()
    note = "model and optimizer" if restored_optimizer else (
        "model only" + ("" if not optimizer else
                        f" (optimizer state was saved by {meta['strategy']} on {meta['world_size']} rank(s), "
                        f"pipeline {'x'.join(map(str, meta.get('pipeline', [1, 1])))}; it restores only under the "
                        "same strategy, world size and pipeline split)"))
    return {"path": path, "dir": os.path.basename(d), "steps": meta["steps"], "saved_by": meta["strategy"],
            "restored": note}


def _pipeline(strategy) -> list:
    """[pp, stages a rank] of ``strategy``'s layout ([1, 1] without a pipeline)."""
    return [getattr(strategy, "pp", 1), getattr(strategy, "virtual", 1)]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path) for f in fs)
