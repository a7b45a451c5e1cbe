"""What every strategy shares: the cell contract and gradient accumulation.

The ledger's counting (ledger.py), data loading (data.py) and the step
optimizer (step_optimizer.py) are modules of their own.

A cell written against this contract runs unchanged under any strategy:

    model, optimizer = strategy.prepare(model, optimizer)
    for batch in strategy.dataloader(dataset, batch_size=8):
        loss = model(batch).mean()
        strategy.backward(loss)
        optimizer.step(); optimizer.zero_grad()
        strategy.log(loss=loss)

``optimizer`` is a thin proxy: with ``--grad-accum N`` its step() and
zero_grad() act only on every Nth backward, so the loop needs no changes.
"""
from __future__ import annotations

import contextlib
import random
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ...metrics import MemoryLedger
from ...spec import StrategySpec
from .. import watchdog
from .data import _EpochLoader, _batch_size
from .ledger import Tally
from .step_optimizer import StepOptimizer


class StrategyError(RuntimeError):
    """A strategy cannot be applied as asked; the message says how to fix it."""


class Strategy:
    """Base class; subclasses implement _wrap, and optionally _backward/_step/_tally (what the ledger counts)."""

    name = "base"

    def __init__(self, spec: StrategySpec, device: torch.device):
        from .. import global_state

        self._globals = global_state.snapshot()  # as this strategy found them (see release)
        self.spec = spec
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.model = None
        self.optimizer: StepOptimizer | None = None
        self.logs: list[dict] = []
        self.notes: list[str] = []  # facts for describe()
        self._micro = 0  # backward() calls
        self._steps = 0  # optimizer steps taken
        self._ledger_at_step: MemoryLedger | None = None
        self._checkpointed: list[str] = []
        self.recorder = None  # set by install() when metrics are on
        self.timeline = None  # a TimelineRecorder under --memory-timeline (nbtool.rank.memory_timeline)
        self.loss_fn = None  # prepare(..., loss_fn=) for forward_backward
        self._plan_arg = None  # prepare(..., plan=) for tensor parallelism
        self._plain = None  # the model as the strategy holds it, before any outer wrapper
        self._model_shape: dict = {}  # layers, hidden, heads, vocab of the plain model (for the planner)
        self.batch_seen: dict = {}  # samples and tokens of the first batch (see _note_batch)
        self._batch_hook = None
        self.compiled: list[str] = []  # what --compile compiled (the strategy's _wrap says)
        self.compile_clock = None  # a CompileClock under --compile (nbtool.rank.compile_time)
        _seed_everything(spec.seed)

    # -- the cell contract ---------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by load(), so a resumed loop knows where it is)."""
        return self._steps

    def resume_at(self, steps: int) -> None:
        """Continue counting optimizer steps from ``steps`` (a loaded checkpoint's)."""
        self._steps = steps

    # -- state for checkpoints (nbtool.rank.checkpoint keeps only the directory protocol) --
    def model_state(self, for_load: bool = False) -> dict:
        """The model state dict by the plain model's names, in the form this strategy holds it.

        Here (fsdp, tp, pp): torch's DCP state-dict API, DTensor shards where
        sharded, a pipeline stage's own part. ``for_load``: tensors to load into.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self._plain)

    @torch.no_grad()
    def apply_model_state(self, sd: dict) -> None:
        """Put a loaded ``model_state(for_load=True)`` into the model."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self._plain, sd)

    def save_optimizer(self, directory: str) -> None:
        """Write the optimizer state under ``directory`` (a collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save(get_optimizer_state_dict(self._plain, self.optimizer.inner),
                 checkpoint_id=os.path.join(directory, "optim"))

    def load_optimizer(self, directory: str) -> None:
        """Restore the optimizer state ``save_optimizer`` wrote (same strategy, world size and pipeline split)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        osd = get_optimizer_state_dict(self._plain, self.optimizer.inner)
        dcp.load(osd, checkpoint_id=os.path.join(directory, "optim"))
        set_optimizer_state_dict(self._plain, self.optimizer.inner, osd)

    @property
    def at_boundary(self) -> bool:
        """True when the last backward() completed an accumulation window."""
        return self._micro % self.spec.grad_accum == 0

    def prepare(self, model: nn.Module, optimizer, *, loss_fn=None, plan: dict | None = None):
        """Wrap ``model`` and ``optimizer`` for this strategy; returns (model, optimizer).

        ``loss_fn(outputs, targets)`` is what ``forward_backward`` uses (pp
        needs it here: its schedule computes the loss on the last stage).
        ``plan`` maps module names (fnmatch patterns allowed) to DTensor
        ParallelStyles for tensor parallelism; without it tp uses
        nbtool.rank.tp_plan.default_plan.
        """
        if self.model is not None:
            raise StrategyError(
                "prepare() was already called in this cell; each %%distributed cell gets a fresh "
                "strategy, so build the model and call prepare once per cell"
            )
        if not isinstance(model, nn.Module):
            raise StrategyError(f"prepare() needs a torch.nn.Module, got {type(model).__name__}")
        if getattr(optimizer, "state", None) and any(optimizer.state.values()):
            raise StrategyError(
                "the optimizer already has state (it has stepped); create it fresh before prepare()"
            )
        if plan is not None and not self.spec.is_mesh:
            raise StrategyError(f"plan= is a tensor-parallel plan; {self.name} does not use one "
                                f"(use %%distributed tp --tp 2, or fsdp --tp 2)")
        self.loss_fn, self._plan_arg = loss_fn, plan
        self._check_model(model)
        self._param_numels = [p.numel() for p in model.parameters()]
        self._model_shape = _shape_of(model)
        if self.spec.activation_checkpointing is not None:
            self._apply_activation_checkpointing(model)
        wrapped, inner = self._wrap(model, optimizer)
        if not self.spec.compile:  # under --compile the hook would be traced, and removing it recompile
            self._batch_hook = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)
        self._set_gradient_sync(self._next_backward_syncs())  # set ahead of the first forward, as backward() does
        if self.spec.compile:  # compilation happens in the first forward and backward
            from ..compile_time import CompileClock

            self.compile_clock = CompileClock(lambda: self._steps)
            self.compile_clock.start()
        self.model = wrapped
        self.optimizer = StepOptimizer(self, inner)
        return wrapped, self.optimizer

    def _note_batch(self, inputs) -> None:
        """Keep the first batch's samples and tokens (the planner's inputs: a run's compute rate is
        per token), from whichever sees it first: strategy.dataloader, forward_backward, or the
        model's first forward (a loop with its own data)."""
        if not self.batch_seen:
            self.batch_seen.update(_batch_size(inputs))

    def _first_forward(self, module, args, kwargs):
        self._note_batch(args if args else kwargs)
        if self.batch_seen and self._batch_hook is not None:
            self._batch_hook.remove()
            self._batch_hook = None

    def backward(self, loss: torch.Tensor) -> None:
        """Backward for one micro-batch (scaled by 1/grad_accum where the wrapper does not)."""
        if self.model is None:
            raise StrategyError("call strategy.prepare(model, optimizer) before strategy.backward(loss)")
        self._micro += 1
        self._backward(loss)
        # the next forward must know whether its backward ends the window
        self._set_gradient_sync(self._next_backward_syncs())

    def _next_backward_syncs(self) -> bool:
        """Whether the next micro-batch's backward reduces its gradients: it ends the accumulation
        window, or every micro-batch reduces (fsdp --reduce-every-micro-batch)."""
        return (self._micro + 1) % self.spec.grad_accum == 0 or self.spec.reduce_every_micro_batch

    def forward_backward(self, inputs, targets, loss_fn=None) -> torch.Tensor:
        """``loss = loss_fn(model(inputs), targets)``, then ``backward(loss)``; returns the loss, detached.

        The same training step under every strategy, including pp (whose
        schedule interleaves the micro-batches' forwards and backwards, so
        forward and backward cannot be separate calls there).
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise StrategyError("forward_backward needs a loss function: strategy.prepare(model, optimizer, "
                                "loss_fn=...) or strategy.forward_backward(inputs, targets, loss_fn=...)")
        if self.model is None:
            raise StrategyError("call strategy.prepare(model, optimizer) before strategy.forward_backward")
        self._note_batch(inputs)
        loss = loss_fn(self.model(inputs), targets)
        self.backward(loss)
        return loss.detach()

    def dataloader(self, dataset, batch_size: int | None = None, shuffle: bool = True,
                   drop_last: bool = False, **kwargs) -> _EpochLoader:
        """Batches of this rank's shard of ``dataset`` (DistributedSampler), on this rank's device.

        Every rank sees a disjoint shard; iterating again starts the next epoch
        (a new shuffle, the same on every rank).
        """
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                     shuffle=shuffle, seed=self.spec.seed, drop_last=drop_last)
        loader = DataLoader(dataset, batch_size=batch_size or self.spec.micro_batch,
                            sampler=sampler, **kwargs)
        return _EpochLoader(loader, sampler, self.device, self.batch_seen)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which shard of the data it reads)."""
        return self.rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas read different data (tp and pp ranks share a batch)."""
        return self.world_size

    def log(self, **scalars) -> None:
        """Record scalars (loss, lr ...) for this rank, tagged with the step."""
        values = {k: v.detach().float().item() if torch.is_tensor(v) else v for k, v in scalars.items()}
        self.logs.append({"step": self._steps, "micro": self._micro, "time": time.time(), **values})
        if self.recorder is not None:
            self.recorder.on_log(self._steps, values)

    def memory_ledger(self) -> MemoryLedger:
        """Model-state bytes this rank holds (see nbtool.metrics.MemoryLedger).

        After an optimizer step: gradients as that step began, parameters and
        optimizer state just after it (model states at their fullest). Before
        any step: what is held now.
        """
        return self._ledger_at_step or self._make_ledger("now")

    def full_state_dict(self) -> dict | None:
        """The complete, unsharded model state dict on rank 0 (None on other ranks).

        A collective: call it on every rank. Tensors are fp32 on CPU, with the
        plain model's keys, so ``plain_model.load_state_dict(sd)`` works.
        """
        if self.model is None:
            raise StrategyError("call strategy.prepare(...) before strategy.full_state_dict()")
        sd = self._full_state_dict()
        if not self.is_main:
            return None
        return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
                for k, v in sd.items()}

    def save(self, path: str) -> dict:
        """Write a checkpoint of model and optimizer to directory ``path`` (every rank calls it).

        Atomic (a crash mid-save leaves the previous checkpoint in ``path``
        loadable) and portable: the weights load under any strategy; see
        nbtool.rank.checkpoint for the layout.
        """
        from .. import checkpoint

        return checkpoint.save(self, path)

    def load(self, path: str, optimizer: bool = True) -> dict:
        """Load the latest checkpoint in ``path`` after prepare(): weights always, the optimizer
        state when this is the strategy and world size that saved it. Restores the step count."""
        from .. import checkpoint

        return checkpoint.load(self, path, optimizer=optimizer)

    def describe(self) -> "Description":
        """Exactly what was applied: wrappers, sharding, precision, offload, buckets, config."""
        return Description(self.name, self._describe())

    def summary(self) -> str:
        """One line for the magic to print after the cell."""
        if self.model is None:
            return f"{self.name}: strategy.prepare(model, optimizer) was not called in this cell"
        return f"{self.name}: " + "; ".join(self._summary_parts())

    def release(self) -> list[str]:
        """Let go of what this strategy set up, when the next strategy cell replaces it.

        Process-wide state it changed (patched torch functions, global hooks,
        modes: nbtool.rank.global_state) is put back; returns what was.
        """
        from .. import global_state

        if self.compile_clock is not None:
            self.compile_clock.stop()
        return global_state.restore(self._globals)

    # -- for subclasses --------------------------------------------------------
    def _wrap(self, model, optimizer):
        raise NotImplementedError

    def _backward(self, loss):
        (loss / self.spec.grad_accum).backward()

    def _set_gradient_sync(self, sync: bool) -> None:
        pass

    def _optimizer_step(self, closure=None):
        if not self.at_boundary:
            return None
        before = self._make_ledger("pre", only=("grads",))  # only its gradients are kept
        out = self._step(closure)
        watchdog.release_finished()  # the step's finished collectives' Works hold their buffers
        self._steps += 1
        after = self._make_ledger(f"step {self._steps}")
        after.grads = before.grads
        after.offloaded.pop("grads", None)
        if before.offloaded.get("grads"):
            after.offloaded["grads"] = before.offloaded["grads"]
        self._ledger_at_step = after
        if self.recorder is not None:
            self.recorder.on_step(self._steps, after)
        if self.timeline is not None:
            self.timeline.on_step(self._steps)
        every = self.spec.checkpoint_every
        if every and self._steps % every == 0:
            self.save(self.spec.checkpoint_dir or "checkpoints")
        return out

    def _step(self, closure=None):
        self._clip()
        return self.optimizer.inner.step(closure)

    def _clip(self) -> None:
        if self.spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)

    def _zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.inner.zero_grad(set_to_none=set_to_none)

    def _tally(self, tally: Tally, offloaded: bool = False) -> None:
        """What the rank holds: the model's parameters (local shards of DTensors), their gradients,
        optimizer.state; on the host when ``offloaded`` (fsdp --offload). zero* counts DeepSpeed's buffers."""
        for p in self._plain.parameters():
            tally.add("params", p, offloaded)
        for p in self._plain.parameters():
            tally.add("grads", p.grad, offloaded)
        tally.add_optimizer_state(self.optimizer.inner.state, offloaded)

    def _make_ledger(self, when: str, only: tuple[str, ...] | None = None) -> MemoryLedger:
        tally = Tally(only)
        self._tally(tally)
        return MemoryLedger(rank=self.rank, strategy=self.name, when=when,
                            offloaded={k: v for k, v in tally.offloaded.items() if v},
                            **{k: int(v) for k, v in tally.bytes.items()})

    def _full_state_dict(self) -> dict:
        raise NotImplementedError

    def _describe(self) -> dict:
        d = {
            "strategy": self.name,
            "world_size": self.world_size,
            "device": str(self.device),
            "precision": self.spec.precision,
            "grad_accum": self.spec.grad_accum,
            "seed": self.spec.seed,
            "grad_clip": self.spec.grad_clip or "none",
        }
        if self._checkpointed:
            d["activation_checkpointing"] = f"{len(self._checkpointed)} x {self._ac_class}"
        if self.optimizer is not None:
            d["optimizer"] = optimizer_name(self.optimizer.inner)
        if self.compiled:
            d["compile"] = f"torch.compile (inductor): {', '.join(self.compiled)}"
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def _summary_parts(self) -> list[str]:
        d = self._describe()
        parts = [d.get("wrapper", "?"), d.get("sharding", ""), f"precision {d['precision']}"]
        if d.get("offload"):
            parts.append(f"offload {d['offload']}")
        if self.spec.grad_accum > 1:
            parts.append(f"grad-accum {self.spec.grad_accum}" + (
                ", each micro-batch's gradients reduce-scattered" if self.spec.reduce_every_micro_batch else ""))
        if self._checkpointed:
            parts.append(f"activation checkpointing on {d['activation_checkpointing']}")
        if self.compiled:
            parts.append("compiled")
        parts.append(f"optimizer {d.get('optimizer', '?')}")
        return [p for p in parts if p]

    # -- model checks and activation checkpointing -------------------------------
    def _check_model(self, model: nn.Module) -> None:
        classes = {type(m).__name__ for m in model.modules()}
        names = [w for w in self.spec.wrap if w != "none"]  # --wrap none: one unit, the whole model
        names += list(self.spec.replicate)
        if self.spec.activation_checkpointing:
            names.append(self.spec.activation_checkpointing)
        for name in names:
            if name not in classes:
                opt = ("--wrap" if name in self.spec.wrap else "--replicate" if name in self.spec.replicate
                       else "--activation-checkpointing")
                raise StrategyError(
                    f"{opt} {name}: the model has no module of class {name}; "
                    f"its classes are {', '.join(sorted(classes))}"
                )

    def _apply_activation_checkpointing(self, model: nn.Module) -> None:
        from ..model_adapters import block_classes

        names = {self.spec.activation_checkpointing} if self.spec.activation_checkpointing else block_classes(model)
        if not names:
            raise StrategyError(
                "--activation-checkpointing without a class name needs a model with a "
                "ModuleList of repeated blocks; name the class to checkpoint"
            )
        self._ac_class = ", ".join(sorted(names))
        if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
            # a Hugging Face model: its own switch, which also keeps the KV cache out of the recomputed
            # forward (a cache written twice would give the replay different shapes)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            layers = [(q, m) for q, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True
                      and m is not model]
            if layers and names <= {type(m).__name__ for _, m in layers}:
                self._checkpointed = [q for q, m in layers if type(m).__name__ in names]
                return
            model.gradient_checkpointing_disable()  # another class was named: checkpoint it as below
        for qualname, module in model.named_modules():
            if type(module).__name__ in names and module is not model:
                _checkpoint_forward(module)
                self._checkpointed.append(qualname)


def param_names(model: nn.Module, optimizer) -> list[list[tuple[str, ...]]]:
    """The optimizer's param groups as parameter names (to re-point them after wrapping); each
    parameter as all its names (a tied weight has several: GPT-2's lm_head.weight is
    transformer.wte.weight, and a pipeline stage may hold it under either)."""
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    try:
        return [[tuple(names[id(p)]) for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise StrategyError("the optimizer holds tensors that are not parameters of this model; "
                            "create it from model.parameters()") from None


def repoint_optimizer(optimizer, model: nn.Module, groups: list, keep_missing: bool = False) -> None:
    """Point the (still empty) optimizer's groups at ``model``'s current parameters, in place.

    Wrappers that replace parameters (fully_shard, parallelize_module) leave
    the user's optimizer holding the old ones; this keeps the user's object
    valid. ``keep_missing``: drop names this rank no longer holds (a pipeline
    stage) instead of refusing.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    for g, group in zip(optimizer.param_groups, groups):
        found = [next((params[n] for n in aliases if n in params), None) for aliases in group]
        missing = [aliases[0] for aliases, p in zip(group, found) if p is None]
        if missing and not keep_missing:
            raise StrategyError(f"optimizer parameter {missing[0]!r} is not a parameter of the model")
        g["params"] = list({id(p): p for p in found if p is not None}.values())


def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of saving them.

    Replaces the instance's forward (keys of the state dict stay the same);
    the non-reentrant checkpoint works with FSDP2 and DeepSpeed hooks.
    """
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under torch.autocast (mixed precision, fp32 weights), in place.

    Replaces the instance's forward, as _checkpoint_forward does, so the state
    dict's keys stay the model's own (a wrapper module would prefix them).
    """
    inner = module.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)

    module.forward = forward


def optimizer_name(opt) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed)


class Description(dict):
    """describe()'s answer: a dict that prints as aligned lines."""

    def __init__(self, name: str, fields: dict):
        super().__init__(fields)
        self.name = name

    def __str__(self) -> str:
        import json

        width = max(len(k) for k in self)
        lines = []
        for k, v in self.items():
            if isinstance(v, dict):
                v = json.dumps(v, indent=2, sort_keys=True).replace("\n", "\n" + " " * (width + 2))
            elif isinstance(v, (list, tuple)):
                v = "\n".join(map(str, v)).replace("\n", "\n" + " " * (width + 2)) if v else "-"
            lines.append(f"{k.ljust(width)}  {v}")
        return "\n".join(lines)

    __repr__ = __str__


def _shape_of(model: nn.Module) -> dict:
    """What the planner needs of the model's structure (nbtool.plan.ModelShape.from_module's fields), its
    ends around the blocks a pipeline would split."""
    from ...plan.inputs import RECORDED_SHAPE, ModelShape, ends_around
    from ..model_adapters import block_list

    shape = ModelShape.from_module(model)
    out = {k: getattr(shape, k) for k in RECORDED_SHAPE}
    try:  # as lists, the record's JSON
        out["ends"] = [list(part) for part in ends_around(model, block_list(model)[0])]
    except StrategyError:  # no repeated blocks: no pipeline
        out["ends"] = []
    return out
