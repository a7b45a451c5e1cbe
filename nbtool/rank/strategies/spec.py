"""What a ``%%distributed STRATEGY ...`` line asks for, and the checks that need no model.

Pure Python (no torch import): the kernel builds and checks a StrategySpec
before anything runs, then sends it to the ranks, which build the strategy
from it. DeepSpeed configs are generated here too, so the kernel can export
exactly the JSON the ranks will use.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field

NAMES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "tp", "pp")
SCHEDULES = ("gpipe", "1f1b")
# strategies that take a --dp/--tp/--pp layout (fsdp: FSDP over the data-parallel dimension)
LAYOUT_NAMES = ("tp", "pp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("optimizer", "params", "both")


class SpecError(ValueError):
    """A strategy option conflict, with the fix in the message."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    precision: str = "fp32"
    grad_accum: int = 1
    activation_checkpointing: str | None = None  # class name, or "" for the repeated block
    seed: int = 0
    grad_clip: float | None = None  # max global gradient norm; None: no clipping
    # ddp
    bucket_mb: float | None = None
    grad_as_bucket_view: bool = False
    static_graph: bool = False
    # fsdp
    reshard_after_forward: bool = True
    wrap: tuple[str, ...] = ()
    # fsdp (policy) and zero (optimizer|params|both)
    offload: str | None = None
    # zero
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    reduce_bucket_mb: float | None = None
    allgather_bucket_mb: float | None = None
    micro_batch: int = 8
    # tp / pp / fsdp: the parallel layout (None: worked out from the world size, see parallel_dims)
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    sp: bool = False  # sequence parallelism in the non-tensor-parallel regions (needs tp > 1)
    microbatches: int | None = None  # pp: micro-batches per batch (default 2 * pp)
    schedule: str | None = None  # pp: gpipe or 1f1b (default 1f1b)
    ds_config: dict | None = field(default=None, compare=False)
    # every N optimizer steps, save a checkpoint to checkpoint_dir (nbtool.rank.checkpoint)
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None

    @property
    def is_zero(self) -> bool:
        return self.name.startswith("zero")

    @property
    def stage(self) -> int:
        return int(self.name[-1]) if self.is_zero else 0

    @property
    def is_mesh(self) -> bool:
        """True when the run needs a device mesh with tp or pp (nbtool.rank.strategies.mesh)."""
        return self.name in ("tp", "pp") or (self.name == "fsdp" and ((self.tp or 1) > 1 or (self.pp or 1) > 1))

    def as_dict(self) -> dict:
        return asdict(self)


def parallel_dims(spec: StrategySpec, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) for ``spec`` on ``world_size`` ranks, checked like torchtitan's ParallelDims.

    The strategy's own dimension (tp for tp, pp for pp, dp for fsdp) takes the
    ranks the others leave when it is not given; after that dp does; anything
    still unset is 1.
    """
    dims = {"dp": spec.dp, "tp": spec.tp, "pp": spec.pp}
    for name, value in dims.items():
        if value is not None and value < 1:
            raise SpecError(f"--{name} {value}: must be >= 1")
    own = {"tp": "tp", "pp": "pp"}.get(spec.name, "dp")
    free = own if dims[own] is None else ("dp" if dims["dp"] is None else None)
    if free is not None:
        fixed = {k: v or 1 for k, v in dims.items() if k != free}
        prod = 1
        for v in fixed.values():
            prod *= v
        if world_size % prod:
            given = " * ".join(f"{k}({v})" for k, v in fixed.items())
            raise SpecError(f"{given} = {prod} does not divide world_size({world_size}); "
                            f"choose sizes whose product divides {world_size}")
        dims[free] = world_size // prod
    dp, tp, pp = (dims[k] or 1 for k in ("dp", "tp", "pp"))
    if dp * tp * pp != world_size:
        raise SpecError(f"dp({dp}) * tp({tp}) * pp({pp}) != world_size({world_size}); "
                        f"the layout must use every rank exactly once")
    if spec.name == "tp" and tp < 2:
        raise SpecError(f"tp({tp}): tensor parallelism needs --tp >= 2 (this cluster has {world_size} ranks)")
    if spec.name == "pp" and pp < 2:
        raise SpecError(f"pp({pp}): pipeline parallelism needs --pp >= 2 (this cluster has {world_size} ranks)")
    return dp, tp, pp


def validate(spec: StrategySpec, backend: str | None = None, device_kind: str = "cpu",
             world_size: int | None = None) -> None:
    """Refuse option combinations that cannot work, before anything runs."""
    n = spec.name
    if n not in NAMES:
        raise SpecError(f"unknown strategy {n!r}; allowed: {', '.join(NAMES)}")
    _validate_layout(spec, world_size)
    if spec.precision not in PRECISIONS:
        raise SpecError(f"--precision {spec.precision!r}; allowed: {', '.join(PRECISIONS)}")
    if spec.grad_clip is not None and spec.grad_clip <= 0:
        raise SpecError(f"--grad-clip {spec.grad_clip}: must be > 0 (omit it for no clipping)")
    if spec.grad_accum < 1:
        raise SpecError(f"--grad-accum {spec.grad_accum}: must be >= 1")
    if spec.checkpoint_dir is not None and spec.checkpoint_every is None:
        raise SpecError(f"--checkpoint-dir {spec.checkpoint_dir!r} needs --checkpoint-every N (optimizer steps)")
    only = {
        "--bucket-mb": (spec.bucket_mb is not None, ("ddp",)),
        "--grad-as-bucket-view": (spec.grad_as_bucket_view, ("ddp",)),
        "--static-graph": (spec.static_graph, ("ddp",)),
        "--no-reshard-after-forward": (not spec.reshard_after_forward, ("fsdp",)),
        "--wrap": (bool(spec.wrap), ("fsdp",)),
        "--offload": (spec.offload is not None, ("fsdp", "zero1", "zero2", "zero3")),
        "--overlap-comm": (spec.overlap_comm is not None, ("zero1", "zero2", "zero3")),
        "--contiguous-gradients": (spec.contiguous_gradients is not None, ("zero1", "zero2", "zero3")),
        "--reduce-bucket-mb": (spec.reduce_bucket_mb is not None, ("zero1", "zero2", "zero3")),
        "--allgather-bucket-mb": (spec.allgather_bucket_mb is not None, ("zero1", "zero2", "zero3")),
        "--ds-config": (spec.ds_config is not None, ("zero1", "zero2", "zero3")),
        "--dp": (spec.dp is not None, LAYOUT_NAMES),
        "--tp": (spec.tp is not None, LAYOUT_NAMES),
        "--pp": (spec.pp is not None, LAYOUT_NAMES),
    }
    for opt, (given, allowed) in only.items():
        if given and n not in allowed:
            fix = {
                "--offload": "use fsdp --offload or zero3 --offload both (DDP keeps a full replica on every device)",
            }.get(opt, f"it applies to {', '.join(allowed)}")
            raise SpecError(f"{opt} does not apply to {n}; {fix}")
    if spec.offload is not None:
        if spec.offload not in OFFLOADS:
            raise SpecError(f"--offload {spec.offload!r}; allowed: {', '.join(OFFLOADS)}")
        if n == "fsdp" and spec.offload != "both":
            raise SpecError(
                f"fsdp --offload {spec.offload}: FSDP's CPUOffloadPolicy moves parameters, gradients and "
                "optimizer state together; use --offload both (or zero2/zero3 to offload one part)"
            )
        if n in ("zero1", "zero2") and spec.offload in ("params", "both"):
            raise SpecError(
                f"{n} --offload {spec.offload}: DeepSpeed offloads parameters only in ZeRO stage 3; "
                "use zero3, or --offload optimizer"
            )
    if spec.precision == "fp16":
        if n == "fsdp":
            raise SpecError(
                "fsdp --precision fp16: nbtool wires no loss scaler into FSDP2, and fp16 without one "
                "underflows; use --precision bf16 (or ddp / zero* with fp16 on GPUs)"
            )
        if spec.is_zero and device_kind == "cpu":
            raise SpecError(
                f"{n} --precision fp16 on CPU ranks: DeepSpeed's CPU accelerator has no fp16 loss "
                "scaling; use --precision bf16"
            )
    if spec.is_zero and backend not in (None, "gloo", "nccl"):
        raise SpecError(f"{n} needs a gloo or nccl process group; this cluster uses {backend}")
    if spec.is_zero and spec.ds_config is not None:
        stage = (spec.ds_config.get("zero_optimization") or {}).get("stage")
        if stage not in (None, spec.stage):
            raise SpecError(
                f"--ds-config has zero_optimization.stage {stage} but the strategy is {n}; "
                f"use %%distributed zero{stage}, or change the file"
            )


def _validate_layout(spec: StrategySpec, world_size: int | None) -> None:
    """The tp/pp/sp options: which strategies take them, and the layout arithmetic."""
    n = spec.name
    if n not in LAYOUT_NAMES:
        for opt, given in (("--dp", spec.dp), ("--tp", spec.tp), ("--pp", spec.pp)):
            if given is not None:
                raise SpecError(f"{opt} does not apply to {n}; it applies to {', '.join(LAYOUT_NAMES)} "
                                f"(e.g. %%distributed fsdp {opt} 2)")
    if world_size is not None and n in LAYOUT_NAMES:
        _, tp, pp = parallel_dims(spec, world_size)
    else:
        tp, pp =  spec.tp or (2 if n == "tp" else 1), spec.pp or (2 if n == "pp" else 1)
    if spec.sp and tp < 2:
        raise SpecError(f"--sp splits activations along the sequence inside a tensor-parallel group; "
                        f"it needs tp >= 2 (got tp({tp})): use %%distributed tp --tp 2 --sp")
    if pp < 2:
        for opt, given in (("--microbatches", spec.microbatches), ("--schedule", spec.schedule)):
            if given is not None:
                raise SpecError(f"{opt} applies to pipeline parallelism; it needs pp >= 2 (got pp({pp})): "
                                f"use %%distributed pp --pp 2 {opt} ...")
    else:
        if spec.schedule is not None and spec.schedule not in SCHEDULES:
            raise SpecError(f"--schedule {spec.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if spec.microbatches is not None and spec.microbatches < pp:
            raise SpecError(f"--microbatches {spec.microbatches} is fewer than the pp({pp}) stages; "
                            f"every stage needs work: use --microbatches >= {pp}")
        if spec.grad_clip is not None:
            raise SpecError("--grad-clip with pipeline parallelism: each stage holds part of the gradients "
                            "and nbtool does not compute their global norm across stages; drop --grad-clip")
        if spec.grad_accum > 1:
            raise SpecError("--grad-accum with pipeline parallelism: the micro-batches already accumulate "
                            "gradients within a step; use --microbatches M")
    if not spec.is_mesh:
        return
    if spec.offload is not None:
        raise SpecError(f"--offload with tp({tp}) / pp({pp}): nbtool offloads only plain fsdp and zero*; "
                        "drop --offload, or use fsdp --offload without --tp/--pp")
    if spec.precision != "fp32" and n != "fsdp":
        raise SpecError(f"{n} --precision {spec.precision}: tp and pp run in fp32; for bf16 use "
                        f"fsdp --tp {tp} (FSDP's MixedPrecisionPolicy over the data-parallel dimension)")


def deepspeed_config(spec: StrategySpec, world_size: int) -> dict:
    """The DeepSpeed JSON for ``spec``: the user's --ds-config, with the options filled in.

    Options given on the line replace the file's values (stage, offload,
    buckets, precision, clipping); ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` from the file are kept when present.

    Runs on a torch optimizer passed as DeepSpeed's client optimizer (no C++
    op to compile), hence zero_allow_untested_optimizer and, with optimizer
    offload, zero_force_ds_cpu_optimizer = false.
    """
    cfg = copy.deepcopy(spec.ds_config) if spec.ds_config else {}
    cfg.setdefault("train_micro_batch_size_per_gpu", spec.micro_batch)
    cfg.setdefault("gradient_accumulation_steps", spec.grad_accum)
    cfg.pop("train_batch_size", None)  # derived by DeepSpeed: micro * accum * world
    # DeepSpeed 0.19's default gradient_clipping is 1.0 (constants.py); DDP and FSDP never clip.
    # Say it explicitly so the same cell means the same maths under every strategy.
    if spec.grad_clip is not None or "gradient_clipping" not in cfg:
        cfg["gradient_clipping"] = spec.grad_clip or 0.0
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = spec.stage
    if spec.overlap_comm is not None:
        zero["overlap_comm"] = spec.overlap_comm
    if spec.contiguous_gradients is not None:
        zero["contiguous_gradients"] = spec.contiguous_gradients
    if spec.reduce_bucket_mb is not None:
        zero["reduce_bucket_size"] = int(spec.reduce_bucket_mb * 2**20)
    if spec.allgather_bucket_mb is not None:
        zero["allgather_bucket_size"] = int(spec.allgather_bucket_mb * 2**20)
    if spec.offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if spec.offload in ("params", "both"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg.pop("fp16", None)
    elif spec.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        cfg.pop("bf16", None)
    elif not spec.ds_config:
        cfg["bf16"] = {"enabled": False}
    cfg.setdefault("zero_allow_untested_optimizer", True)
    if "offload_optimizer" in zero:
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    cfg.setdefault("steps_per_print", 10**9)  # keep DeepSpeed's periodic log out of cells
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def dumps_config(cfg: dict) -> str:
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
