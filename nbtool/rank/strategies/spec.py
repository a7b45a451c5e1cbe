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

NAMES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
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

    def as_dict(self) -> dict:
        return asdict(self)


def validate(spec: StrategySpec, backend: str | None = None, device_kind: str = "cpu") -> None:
    """Refuse option combinations that cannot work, before anything runs."""
    n = spec.name
    if n not in NAMES:
        raise SpecError(f"unknown strategy {n!r}; allowed: {', '.join(NAMES)}")
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
