"""Tensor, sequence and pipeline parallelism, alone or inside data parallelism (tp, pp, fsdp --tp).

The ranks form a DeviceMesh with dims ("pp", "dp", "tp"), tp innermost so a
tensor-parallel group is neighbouring ranks (on GPUs, the fastest links), as
in torchtitan. One mesh per layout per engine life. ``prepare`` applies the
dimensions in torchtitan's order:

1. pp: cut the model down to this rank's stage (nbtool.rank.pipeline);
2. tp: ``parallelize_module`` with the plan (nbtool.rank.tp_plan);
3. dp: ``fsdp``: fully_shard each block and the stage root over the dp
   mesh dimension (FSDP over data parallel, TP inside); ``tp``/``pp``: plain
   replicas whose gradients are averaged over dp before each step (one
   coalesced all-reduce).

Under pp, forward and backward of the micro-batches interleave inside the
schedule, so a cell trains with ``loss = strategy.forward_backward(x, y)``
(which works under every strategy).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...metrics import PipelineStep
from .base import Strategy, StrategyError, autocast_forward, param_names, repoint_optimizer
from ...spec import ParallelDims, pipeline_schedule, stage_indices
from ..groups import layout_mesh



class MeshStrategy(Strategy):
    def __init__(self, spec, device):
        super().__init__(spec, device)
        self.name = spec.name
        self.dims = ParallelDims.resolve(spec, self.world_size)
        self.dp, self.tp, self.pp = self.dims
        self.mesh = layout_mesh(device.type, self.dims)
        self.coords = {d: self.mesh.get_local_rank(d) for d in ("pp", "dp", "tp")}
        self.microbatches = spec.microbatches or 2 * self.pp
        self.schedule, self.virtual = pipeline_schedule(spec)
        self.stage_ids = stage_indices(self.coords["pp"], self.pp, self.virtual, self.schedule)
        self.stages_total = self.pp * self.virtual
        self.plan: dict = {}
        self.whole_parts: list[str] = []  # block parts the tp plan leaves replicated (_check_coverage)
        self.stage_parts: list[str] = []
        self.units: list[str] = []
        self.heads: list[str] = []
        self._pipe = None  # (schedule, clock) under pp
        self._tied: list = []  # [(names, meta tensor like it)]: weights tied across pipeline stages
        self._permuted: dict = {}  # {param name: (QKVPermutation, dim)}: fused q/k/v sharded in permuted order
        self._in_schedule = False

    # -- layout ------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def is_first_stage(self) -> bool:
        """This rank runs the first stage (it feeds the inputs)."""
        return 0 in self.stage_ids

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the last stage (it computes the loss)."""
        return self.stages_total - 1 in self.stage_ids

    def _last_stage_rank(self) -> int:
        """The global rank, in this rank's pipeline group, that runs the last stage."""
        holder = next(r for r in range(self.pp) if self.stages_total - 1 in
                      stage_indices(r, self.pp, self.virtual, self.schedule))
        return dist.get_global_rank(self.mesh["pp"].get_group(), holder)

    # -- wrapping ------------------------------------------------------------------
    def _wrap(self, model, optimizer):
        from . import fsdp as fsdp_module
        from .. import pipeline, tp_plan

        groups = param_names(model, optimizer)
        plan = self._plan_arg
        if plan is not None:
            if self.tp < 2:
                raise StrategyError(f"plan= needs tensor parallelism (tp >= 2); this layout has tp({self.tp})")
            tp_plan.check_plan(plan, model, self.tp)  # on the whole model: catches typos on every stage
        if self.pp > 1:
            if self.loss_fn is None:
                raise StrategyError("pp runs forward and backward together per micro-batch, so it needs the "
                                    "loss: strategy.prepare(model, optimizer, loss_fn=loss_fn), then "
                                    "loss = strategy.forward_backward(inputs, targets)")
            split = (f"pp({self.pp}) x {self.virtual} virtual stages = {self.stages_total} stages"
                     if self.virtual > 1 else f"pp({self.pp}) stages")
            runs, self.stage_parts, self._tied = pipeline.split_stages(model, self.stage_ids, self.stages_total,
                                                                       split)
            if plan is not None:  # keep the entries for this stage's modules
                plan = {k: v for k, v in plan.items() if tp_plan.matching({k: v}, model)[k]}
        model.to(self.device)
        if self.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            if plan is None:
                plan = tp_plan.default_plan(model, self.spec.sp, self.mesh["tp"],
                                            self._stage_blocks(model) if self.pp > 1 else None)
                tp_plan.check_plan(plan, model, self.tp)
                self._check_coverage(plan, model, tp_plan)
            self.heads = tp_plan.localize_heads(plan, model, self.tp)
            parallelize_module(model, self.mesh["tp"], plan)
            self.plan = plan
            self._permuted = tp_plan.permuted_params(plan, model)
        if self.spec.compile:  # this stage's blocks, before FSDP (tp is refused: spec.py)
            from ..compile_time import compile_blocks

            self.compiled = compile_blocks(model)
        if self.name == "fsdp":  # the stage's root is what the schedule runs (torch's pipelining then
            # keeps each unit gathered, its gradients unsynced, until the last micro-batch)
            self.units, _ = fsdp_module.shard_units(model, self.mesh["dp"], self.spec,
                                                    root=runs[0] if self.pp > 1 else None)
        elif self.spec.precision == "bf16":  # fsdp's is its MixedPrecisionPolicy
            for run in runs if self.pp > 1 else [model]:
                autocast_forward(run, self.device.type, torch.bfloat16)
        repoint_optimizer(optimizer, model, groups, keep_missing=self.pp > 1)
        self._plain = model
        if self.tp > 1 and self.pp > 1:  # each pipeline rank's tp figures (its stages differ), for the planner
            mine = (self._tp_replicated(), sum(style_text(v).startswith("Rowwise") for v in self.plan.values()))
            self.tp_by_pp_rank = [None] * self.pp
            dist.all_gather_object(self.tp_by_pp_rank, mine, group=self.mesh["pp"].get_group())
        if self.pp > 1:
            self._pipe = pipeline.build_schedule(runs, self.stage_ids, self.stages_total, self.device,
                                                 self.mesh["pp"].get_group(), self.schedule,
                                                 self.microbatches, self.loss_fn)
            model.register_forward_pre_hook(self._refuse_direct_forward)
        return model, optimizer

    def _stage_blocks(self, model) -> list:
        """The block keys of each stage this rank runs (the cut model keeps them under their global indices)."""
        from .. import pipeline
        from ..model_adapters import block_list

        per = len(block_list(model)[1]) // len(self.stage_ids)
        return [pipeline.stage_block_keys(s, per) for s in sorted(self.stage_ids)]

    def _tp_replicated(self) -> int:
        """Elements of this rank's model that tensor parallelism leaves whole (embeddings, norms)."""
        return sum(p.numel() for p in self._plain.parameters() if "tp" not in _sharded_on(p))

    def _check_coverage(self, plan, model, tp_plan) -> None:
        """Before anything is sharded: refuse a plan that would train wrong, say what it leaves whole."""
        replicated, norms = tp_plan.coverage(plan, model, self.spec.sp)
        if self.spec.sp and (replicated or norms):
            parts = ([f"replicated: {', '.join(replicated[:4])}{' ...' if len(replicated) > 4 else ''}"]
                     if replicated else []) + ([f"norms not sequence-parallel: {', '.join(norms[:4])}"] if norms else [])
            raise StrategyError(
                "--sp splits every block's input along the sequence, so every part of a block must be sharded "
                f"or sequence-parallel; the default plan leaves {'; '.join(parts)}. {tp_plan.WHAT_IS_SPLIT} Pass "
                "plan={...} to strategy.prepare for other shapes, or drop --sp")
        self.whole_parts = list(replicated)
        if replicated:
            self.notes.append("tensor parallelism leaves these block parts replicated (not sharded; every rank "
                              f"computes them whole): {', '.join(replicated)}. {tp_plan.WHAT_IS_SPLIT}")

    def _refuse_direct_forward(self, module, args):
        if not self._in_schedule:
            raise StrategyError("under pp each rank holds one stage, so model(x) cannot run the whole model: "
                                "train with loss = strategy.forward_backward(inputs, targets)")

    def _set_gradient_sync(self, sync: bool) -> None:
        if self.name == "fsdp" and self.pp == 1 and self._plain is not None:
            self._plain.set_requires_gradient_sync(sync)

    # -- training --------------------------------------------------------------------
    def _backward(self, loss):
        if self.pp > 1:
            raise StrategyError("under pp the schedule runs backward itself: "
                                "use loss = strategy.forward_backward(inputs, targets)")
        super()._backward(loss)

    def forward_backward(self, inputs, targets, loss_fn=None):
        """Under pp: run the schedule over the batch's micro-batches; returns the batch's mean loss
        on every rank (broadcast from the last stage). Otherwise as Strategy.forward_backward."""
        if self.pp == 1:
            return super().forward_backward(inputs, targets, loss_fn)
        from ..pipeline import check_batch, scale_once

        if self.model is None:
            raise StrategyError("call strategy.prepare(model, optimizer, loss_fn=...) before forward_backward")
        if loss_fn is not None and loss_fn is not self.loss_fn:
            raise StrategyError("under pp the loss is fixed when the schedule is built: "
                                "pass it as strategy.prepare(model, optimizer, loss_fn=...)")
        check_batch(inputs, self.microbatches)
        self._note_batch(inputs)  # the whole batch, as the planner counts it (split into micro-batches)
        schedule, clock = self._pipe
        losses: list = []
        clock.compute_s = 0.0
        t0 = time.perf_counter()
        self._in_schedule = True
        args = (inputs,) if self.is_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if self.is_last_stage else {}
        try:
            schedule.step(*args, **kwargs)
        finally:
            self._in_schedule = False
        if self.virtual > 1:
            scale_once(self._plain, self.microbatches)
        step_s = time.perf_counter() - t0
        self._micro += 1
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else \
            torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self._last_stage_rank(), group=self.mesh["pp"].get_group())
        if self.recorder is not None:
            self.recorder.on_record(PipelineStep(
                rank=self.rank, step=self._steps + 1, t=time.time(), stage=self.coords["pp"], stages=self.pp,
                microbatches=self.microbatches, schedule=self.schedule, step_s=step_s,
                compute_s=clock.compute_s, virtual=self.virtual))
        return loss

    def _step(self, closure=None):
        self._reduce_partial_grads()
        self._sum_tied_grads()
        if self.dp > 1 and self.name != "fsdp":
            self._average_over_dp()
        if self.spec.grad_clip:
            self._clip_global(self.spec.grad_clip)
        return self.optimizer.inner.step(closure)

    @torch.no_grad()
    def _clip_global(self, max_norm: float) -> torch.Tensor:
        """--grad-clip on the whole model's gradient norm, however the layout splits it, then scale
        every gradient by max_norm / (norm + 1e-6) when below 1 (clip_grad_norm_'s maths).

        Each rank sums the squares of what it holds; a shard's sum is added over the mesh
        dimensions it is sharded on (tp, and dp under fsdp), a replica's is counted once, and the
        stages' sums are added over pp (torchtitan's pipeline clip). A weight tied across stages
        is counted on the stage holding its first name only.
        """
        from torch.distributed.tensor import DTensor

        here: dict = {}  # id -> (parameter, its names on this stage)
        for n, p in self._plain.named_parameters(remove_duplicate=False):
            here.setdefault(id(p), (p, set()))[1].add(n)
        grads = [p.grad for p, names in here.values() if p.grad is not None and all(
            tied[0] in names for tied, _ in self._tied if not names.isdisjoint(tied))]
        sums: dict = {}  # mesh dims a gradient is sharded on -> sum of squares of this rank's parts
        for g in grads:
            key, local = _sharded_on(g), (g.to_local() if isinstance(g, DTensor) else g)
            sums[key] = sums.get(key, 0.0) + local.detach().float().pow(2).sum()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for key in sorted(sums):
            part = torch.as_tensor(sums[key], dtype=torch.float32, device=self.device).clone()
            for dim in key:
                dist.all_reduce(part, group=self.mesh[dim].get_group())
            total += part
        if self.pp > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self._plain.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
        return norm

    @torch.no_grad()
    def _reduce_partial_grads(self) -> None:
        """Sum the gradients DTensor left partial (sequence-parallel norms) across tp, in one
        all-reduce, as Megatron does; otherwise each optimizer op would all-reduce them again."""
        from torch.distributed.tensor import DTensor

        partial = [p for p in self._plain.parameters()
                   if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
        if not partial:
            return
        local = [p.grad.to_local() for p in partial]
        flat = torch._utils._flatten_dense_tensors(local)
        dist.all_reduce(flat, group=self.mesh["tp"].get_group())
        for p, t in zip(partial, torch._utils._unflatten_dense_tensors(flat, local)):
            p.grad = DTensor.from_local(t, p.grad.device_mesh, p.placements, run_check=False)

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """A weight tied across stages (embedding and head) has a copy on each: sum their gradients
        over the pipeline (stages without it add zeros), so every copy takes the same step."""
        if not self._tied:
            return
        params = dict(self._plain.named_parameters(remove_duplicate=False))
        group = self.mesh["pp"].get_group()
        for names, like in self._tied:
            p = next((params[n] for n in names if n in params), None)
            grad = p.grad if p is not None else None
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            buf = local if local is not None else torch.zeros(like.shape, dtype=like.dtype, device=self.device)
            dist.all_reduce(buf, group=group)
            if p is not None and p.grad is None:
                p.grad = buf

    @torch.no_grad()
    def _average_over_dp(self) -> None:
        """Data-parallel replicas (tp/pp with dp > 1): average the local gradients over dp."""
        local = [g.to_local() if hasattr(g, "to_local") else g
                 for g in (p.grad for p in self._plain.parameters()) if g is not None]
        if not local:
            return
        flat = torch._utils._flatten_dense_tensors(local)
        dist.all_reduce(flat, group=self.mesh["dp"].get_group())
        flat /= self.dp
        for t, new in zip(local, torch._utils._unflatten_dense_tensors(flat, local)):
            t.copy_(new)

    # -- state -----------------------------------------------------------------------
    def _model_layout(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """A full tensor in the plain model's layout (a fused q/k/v weight back in [q | k | v] order)."""
        if key not in self._permuted:
            return full
        permutation, dim = self._permuted[key]
        return permutation.undo(full, dim)

    def model_state(self, for_load: bool = False) -> dict:
        """DCP's state dict, except fused q/k/v weights: full tensors in the model's layout, so a
        checkpoint holds the same matrix whichever strategy wrote it."""
        sd = super().model_state(for_load)
        for key in self._permuted:
            if key in sd:
                sd[key] = self._model_layout(key, sd[key].full_tensor())
        return sd

    @torch.no_grad()
    def apply_model_state(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import distribute_tensor

        fused = {k: sd.pop(k) for k in list(sd) if k in self._permuted}
        set_model_state_dict(self._plain, sd, options=StateDictOptions(strict=not fused))
        params = dict(self._plain.named_parameters())
        for key, full in fused.items():
            permutation, dim = self._permuted[key]
            p = params[key]
            p.copy_(distribute_tensor(permutation.apply(full.to(p.device, p.dtype), dim), p.device_mesh,
                                      p.placements))

    def _full_state_dict(self):
        from torch.distributed.tensor import DTensor

        sd = {k: self._model_layout(k, v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
              for k, v in self._plain.state_dict().items()}
        if self.pp > 1:  # each stage holds its own part: collect them (one copy per stage)
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, sd if self.coords["dp"] == 0 and self.coords["tp"] == 0 else {})
            sd = {k: v for part in parts for k, v in part.items()}
        return sd

    # -- description ---------------------------------------------------------------------
    def _describe(self):
        from ...spec import bubble_fraction

        d = super()._describe()
        parts = []
        if self.tp > 1:
            parts.append("DTensor parallelize_module (tp" + (" + sp" if self.spec.sp else "") + ")")
        if self.pp > 1:
            parts.append(f"torch.distributed.pipelining {self.schedule}")
        if self.name == "fsdp":
            parts.append("fully_shard over dp (FSDP2)")
        elif self.dp > 1:
            parts.append(f"gradients averaged over dp({self.dp})")
        d["wrapper"] = " + ".join(parts)
        d["sharding"] = f"dp({self.dp}) x tp({self.tp}) x pp({self.pp})"
        if self.tp > 1 and self._plain is not None:  # what the plan leaves whole (embeddings, norms), for the planner
            d["tp_replicated_elements"] = self._tp_replicated()
            if self.pp > 1:  # per pipeline rank: (elements left whole, row-parallel parts split)
                d["tp_by_pp_rank"] = self.tp_by_pp_rank
            d["tp_whole_parts"] = len(self.whole_parts)  # their collectives are not issued
        c = self.coords
        d["mesh"] = (f"DeviceMesh ('pp', 'dp', 'tp') = ({self.pp}, {self.dp}, {self.tp}); this rank is "
                     f"pp {c['pp']}, dp {c['dp']}, tp {c['tp']}")
        if self.plan:
            d["plan"] = {k: style_text(v) for k, v in self.plan.items()}
        if self.heads:
            d["heads"] = list(self.heads)
        if self.pp > 1:
            held = (f"stages {', '.join(map(str, self.stage_ids))} of {self.stages_total}" if self.virtual > 1
                    else f"{c['pp']} of {self.pp}")
            d["stage"] = f"{held}: {', '.join(self.stage_parts)}"
            if self._tied:
                d["tied"] = [" = ".join(names) + " (a copy per stage, gradients summed over pp)"
                             for names, _ in self._tied]
                d["pp_tied_elements"] = [like.numel() for _, like in self._tied]  # for the planner
            theory = bubble_fraction(self.pp, self.microbatches, self.schedule, self.virtual)
            formula = {"zbv": "0 (F = B = W)", "interleaved-zb": "(p-1)/(3VM+p-1)",
                       "interleaved-1f1b": "(p-1)/(VM+p-1)"}.get(self.schedule, "(p-1)/(M+p-1)")
            per_rank = f", {self.virtual} stages per rank" if self.virtual > 1 else ""
            d["schedule"] = (f"{self.schedule}, {self.microbatches} micro-batches per batch{per_rank}; bubble "
                             f"for equal stages {formula} = {theory:.1%}")
        if self.units:
            d["units"] = list(self.units)
        if self.name == "fsdp" and self.spec.precision == "bf16":
            d["mixed_precision"] = "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)"
        elif self.spec.precision == "bf16":
            d["mixed_precision"] = ("torch.autocast(bf16) around the " + ("stage's" if self.pp > 1 else "model's")
                                    + " forward: bf16 matmuls; weights, gradients and the residual stream in fp32 "
                                    "(so pipeline messages stay fp32; fsdp --tp/--pp casts the weights instead)")
        return d


def style_text(style) -> str:
    """A ParallelStyle in a few words: ``RowwiseParallel(Shard(dim=-1) -> Replicate())``."""
    name = type(style).__name__

    def layouts(x):
        x = x if isinstance(x, (tuple, list)) else (x,)
        return ", ".join(repr(p) for p in x if p is not None)

    if hasattr(style, "input_layouts") and hasattr(style, "output_layouts"):
        return f"{name}({layouts(style.input_layouts)} -> {layouts(style.output_layouts)})"
    if hasattr(style, "input_layouts"):
        return f"{name}({layouts(style.input_layouts)} -> {layouts(style.desired_input_layouts)})"
    if hasattr(style, "output_layouts"):
        return f"{name}({layouts(style.output_layouts)} -> {layouts(style.desired_output_layouts)})"
    return name


def _sharded_on(t) -> tuple[str, ...]:
    """The mesh dimensions a tensor is split on (Shard placements of a DTensor; none for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return ()
    names = t.device_mesh.mesh_dim_names
    return tuple(names[i] for i, pl in enumerate(t.placements) if isinstance(pl, Shard))
