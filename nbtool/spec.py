"""What a ``%%distributed STRATEGY ...`` line asks for, and the checks that need no model.

Pure Python (no torch import): the kernel builds and checks a StrategySpec
before anything runs, then sends it to the ranks, which build the strategy
from it. DeepSpeed configs are generated here too, so the kernel can export
exactly the JSON the ranks will use.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, fields

NAMES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "tp", "pp")
# torch.distributed.pipelining's schedules: one stage per rank, then several (virtual stages) per rank
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zb", "zbv")


COMPRESSIONS = ("fp16", "bf16", "powersgd")


def compression(spec: "StrategySpec") -> tuple[str, int, int] | None:
    """(kind, PowerSGD rank, PowerSGD start step) of ``--compress``, or None."""
    if spec.compress is None:
        return None
    kind, *nums = spec.compress.split(":")
    if kind not in COMPRESSIONS or (nums and kind != "powersgd") or len(nums) > 2 or not all(
            n.isdigit() and int(n) > 0 for n in nums):
        raise SpecError(f"--compress {spec.compress!r}; allowed: fp16, bf16, powersgd[:RANK[:START]] "
                        "(RANK and START positive integers)")
    rank, start = (list(map(int, nums)) + [1, 2][len(nums):])[:2]
    if kind == "powersgd" and start < 2:
        raise SpecError(f"--compress {spec.compress!r}: PowerSGD with error feedback starts at step 2 or later")
    return kind, rank, start


def bubble_fraction(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Idle fraction of a step in theory: p ranks, M micro-batches, V stages per rank, every stage
    equally fast and communication free, a backward twice a forward (B + W = 2F).

    GPipe, 1F1B: (p - 1) / (M + p - 1). Interleaved 1F1B (Megatron's): the warm-up and drain are
    of chunks 1/V the size, (p - 1) / (V M + p - 1). Interleaved zero bubble (ZB-1P, ZB-H1 per chunk):
    the weight gradients fill two thirds of each gap, (p - 1) / (3 V M + p - 1). ZB-V: with F = B = W
    the V shape fills the bubble entirely, 0 (the paper's (p - 1)(F + B - 2W)).
    """
    p, m, v = stages, microbatches, virtual
    if schedule == "zbv":
        return 0.0
    if schedule == "interleaved-zb":
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def stage_indices(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``rank`` runs: itself with one per rank; with ``virtual`` per rank,
    every pp-th stage (the interleaved loop), or ZB-V's V shape (rank and 2 pp - 1 - rank)."""
    if virtual == 1:
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(virtual)]


def stage_actions(virtual: int, schedule: str) -> float:
    """Stage computations a rank runs per micro-batch, relative to 1F1B's forward and backward: one pair
    per stage it holds, and a third (the weight gradients, apart from the input gradients) under the zero
    bubble schedules."""
    return virtual * (1.5 if schedule in ("interleaved-zb", "zbv") else 1.0)


def first_rank_held(pp: int, virtual: int, microbatches: int, schedule: str) -> float:
    """Activations pipeline rank 0 holds at its peak, in layers' worth over 1F1B's (L: p micro-batches of
    its L/p layers). Interleaved 1F1B (torch's ScheduleInterleaved1F1B) runs (V-1) p + 2 (p-1) forward
    chunks of L/(p V) layers before its first backward, and one more in its steady state: 1 + (p-1)/(p V)
    when the micro-batches allow (Megatron's figure); on 2 ranks x 2 stages, 4 micro-batches, the planner
    had put peak tensor memory 12-13% short on 3 shapes, and puts it 4-7% short so. The other schedules: 1
    (as for 1F1B, never less: the planner's 1F1B holds L layers' worth even with fewer micro-batches)."""
    if schedule != "interleaved-1f1b" or virtual < 2:
        return 1.0
    return max(1.0, min(microbatches * virtual, (virtual - 1) * pp + 2 * (pp - 1) + 1) / (pp * virtual))


def first_rank_hops(pp: int, virtual: int, schedule: str) -> int:
    """Stage boundaries between two ranks that pipeline rank 0 sends or receives across: each
    carries M activations one way and M gradients back. 1 with one stage per rank; for 2 ranks x 2
    stages, 3 interleaved (0-1, 1-2, 2-3) and 2 for ZB-V (its 1-2 hop stays on rank 1)."""
    where = {s: r for r in range(pp) for s in stage_indices(r, pp, virtual, schedule)}
    mine = set(stage_indices(0, pp, virtual, schedule))
    return sum(1 for s in range(pp * virtual - 1) if where[s] != where[s + 1] and (s in mine or s + 1 in mine))


def pipeline_schedule(spec: "StrategySpec") -> tuple[str, int]:
    """(schedule, stages per rank) of a pp line: --virtual-stages alone means interleaved-1f1b; a
    multi-stage schedule alone means 2 per rank; default 1f1b with one."""
    v = spec.virtual_stages
    schedule = spec.schedule or ("interleaved-1f1b" if (v or 1) > 1 else "1f1b")
    return schedule, v or (2 if schedule in MULTI_STAGE else 1)
# strategies that take a --dp/--tp/--pp layout (fsdp: FSDP over the data-parallel dimension)
LAYOUT_NAMES = ("tp", "pp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("optimizer", "params", "both")


class SpecError(ValueError):
    """A strategy option conflict, with the fix in the message."""


ZERO_NAMES = ("zero1", "zero2", "zero3")
# --memory-timeline records this many optimizer steps unless --timeline-steps says otherwise: step 1
# (the set-up) and four typical steps; each recorded step costs the analysis after the cell 25 MB a
# rank for the tutorial model, 0.5 GB under fsdp --tp 2 --pp 2 on 8 ranks
TIMELINE_STEPS_DEFAULT = 5


def option(default=None, *, group: str, help: str, applies: tuple[str, ...] = NAMES, kind: str = "value",
           refuse: str | None = None, compare: bool = True, **argparse):
    """A StrategySpec field that is also a ``%%distributed`` option (the one table of options).

    Its name on the line is the field's, dashed. ``kind``: how the magic parses it: "value" (one argument,
    ``argparse`` keywords such as choices, metavar, nargs, const; ``type`` names a checked type of
    nbtool.options), "switch" (a store_true flag), "off" (``--no-X`` turns a True default off; ``--X`` is
    accepted too), "both" (``--X`` / ``--no-X``, None when neither is given); what argparse stores when the
    option is absent is ``ABSENT[kind]`` (None: the field keeps ``default``); ``applies``: the strategies it
    applies to (others refuse it, with ``refuse`` as the fix when given); ``group``: the section of
    ``%%distributed?`` it is listed in.
    """
    return field(default=default, compare=compare, metadata={
        "option": True, "group": group, "help": help, "applies": applies, "kind": kind, "refuse": refuse,
        "argparse": argparse})


# what argparse stores for an option the line left out, by kind (see option)
ABSENT = {"value": None, "switch": False, "off": True, "both": None}


# sections of %%distributed? in this order; each option names its own
GROUPS = ("training options", "ddp options", "fsdp options", "zero options", "layout options (tp, pp, fsdp)",
          "checkpoint options", "recording options")


@dataclass(frozen=True)
class StrategySpec:
    name: str
    precision: str = option("fp32", group="training options", choices=PRECISIONS,
                            help="fp32 (default); bf16/fp16 mixed precision as each strategy implements it")
    grad_accum: int = option(1, group="training options", type="positive_int", metavar="N",
                             help="accumulate gradients over N backward() calls per optimizer step")
    # class name, or "" for the repeated block
    activation_checkpointing: str | None = option(
        None, group="training options", nargs="?", const="", metavar="CLASS",
        help="recompute activations of modules of CLASS in backward (default: the repeated block)")
    seed: int = option(0, group="training options", type="int",
                       help="seed torch/random/numpy on every rank (default 0)")
    compile: bool = option(False, group="training options", kind="switch",
                           help="torch.compile (inductor): the DDP-wrapped model, each repeated block before "
                                "FSDP or pipeline stages, DeepSpeed's engine.compile(); compile seconds "
                                "reported apart from the step times")
    grad_clip: float | None = option(  # max global gradient norm; None: no clipping
        None, group="training options", type="positive_number", metavar="NORM",
        help="clip the global gradient norm at NORM before each step (default: no clipping)")
    # ddp
    bucket_mb: float | None = option(None, group="ddp options", applies=("ddp",), type="positive_number",
                                     help="gradient bucket size in MiB")
    grad_as_bucket_view: bool = option(False, group="ddp options", applies=("ddp",), kind="switch",
                                       help="gradients are views into buckets")
    static_graph: bool = option(False, group="ddp options", applies=("ddp",), kind="switch",
                                help="the graph is the same every step")
    compress: str | None = option(  # a DDP communication hook (nbtool.rank.strategies.ddp)
        None, group="ddp options", applies=("ddp",), metavar="fp16|bf16|powersgd[:RANK[:START]]",
        refuse="it is a DDP communication hook; use %%distributed ddp --compress ...",
        help="compress gradients for the all-reduce: fp16/bf16 (half the bytes; bf16 on CUDA ranks) or "
             "PowerSGD of rank RANK (default 1) from step START (default 2; vanilla before; CUDA ranks)")
    # fsdp
    reshard_after_forward: bool = option(
        True, group="fsdp options", applies=("fsdp",), kind="off",
        help="keep gathered parameters until backward (ZeRO-2-like); by default they are freed after "
             "forward (ZeRO-3-like)")
    # with --grad-accum: False keeps each unit's gradients unsharded in fp32 until the window's last
    # micro-batch (set_requires_gradient_sync(False), torch's gradient accumulation "without communication")
    reduce_every_micro_batch: bool = option(
        False, group="fsdp options", applies=("fsdp",), kind="switch",
        help="--grad-accum: reduce-scatter every micro-batch's gradients and add up the shards (no unsharded "
             "fp32 gradients held between micro-batches: less memory, N times the reduce-scatters)")
    wrap: tuple[str, ...] = option((), group="fsdp options", applies=("fsdp",), type="class_list",
                                   metavar="CLASS[,CLASS]",
                                   help="shard modules of these classes as their own units (root wrapped last); "
                                        "default: the repeated blocks (a Hugging Face model's _no_split_modules); "
                                        "none: the whole model as one unit")
    replicate: tuple[str, ...] = option(
        (), group="fsdp options", applies=("fsdp",), type="class_list", metavar="CLASS[,CLASS]",
        help="keep modules of these classes whole on every rank, their gradients all-reduced (PyTorch's "
             "FSDP2-based replicate), while the rest is sharded: e.g. --replicate Embedding")
    # HSDP: a (dp_replicate, dp_shard) mesh; None: unset (plain FSDP over the world)
    dp_replicate: int | None = option(None, group="fsdp options", applies=("fsdp",), type="positive_int",
                                      metavar="R", help="hybrid sharding (HSDP): R replicas of the sharded "
                                      "model, gradients all-reduced across them (default: world / S)")
    dp_shard: int | None = option(None, group="fsdp options", applies=("fsdp",), type="positive_int",
                                  metavar="S", help="hybrid sharding (HSDP): shard over groups of S "
                                  "neighbouring ranks (on a multi-node cluster, a node; default: world / R)")
    # fsdp (policy) and zero (optimizer|params|both)
    offload: str | None = option(
        None, group="zero options", applies=("fsdp",) + ZERO_NAMES, nargs="?", const="both", choices=OFFLOADS,
        refuse="use fsdp --offload or zero3 --offload both (DDP keeps a full replica on every device)",
        help="zero*: offload optimizer, params (zero3) or both to cpu; fsdp: CPUOffloadPolicy (both)")
    # zero
    overlap_comm: bool | None = option(None, group="zero options", applies=ZERO_NAMES, kind="both",
                                       help="overlap gradient reduction with backward")
    contiguous_gradients: bool | None = option(None, group="zero options", applies=ZERO_NAMES, kind="both",
                                               help="copy gradients into one contiguous buffer")
    reduce_bucket_mb: float | None = option(None, group="zero options", applies=ZERO_NAMES,
                                            type="positive_number",
                                            help="reduce bucket size, MiB (DeepSpeed's default: 5e8 elements)")
    allgather_bucket_mb: float | None = option(None, group="zero options", applies=ZERO_NAMES,
                                               type="positive_number",
                                               help="all-gather bucket size, MiB (DeepSpeed's default: 5e8 elements)")
    micro_batch: int = option(8, group="zero options", type="positive_int",
                              help="train_micro_batch_size_per_gpu in the DeepSpeed config (default 8)")
    # tp / pp / fsdp: the parallel layout (None: worked out from the world size, see ParallelDims)
    dp: int | None = option(None, group="layout options (tp, pp, fsdp)", applies=LAYOUT_NAMES,
                            type="positive_int", metavar="D", refuse="it applies to tp, pp, fsdp "
                            "(e.g. %%distributed fsdp --dp 2)",
                            help="data-parallel size of the layout (default: the ranks left over)")
    tp: int | None = option(None, group="layout options (tp, pp, fsdp)", applies=LAYOUT_NAMES,
                            type="positive_int", metavar="T", refuse="it applies to tp, pp, fsdp "
                            "(e.g. %%distributed fsdp --tp 2)",
                            help="tensor-parallel size (DTensor ColwiseParallel/RowwiseParallel plan)")
    pp: int | None = option(None, group="layout options (tp, pp, fsdp)", applies=LAYOUT_NAMES,
                            type="positive_int", metavar="P", refuse="it applies to tp, pp, fsdp "
                            "(e.g. %%distributed fsdp --pp 2)",
                            help="pipeline stages (torch.distributed.pipelining)")
    # sequence parallelism in the non-tensor-parallel regions (needs tp > 1; checked with the layout)
    sp: bool = option(False, group="layout options (tp, pp, fsdp)", kind="switch",
                      help="tp: sequence parallelism (activations split along the sequence outside TP regions)")
    microbatches: int | None = option(None, group="layout options (tp, pp, fsdp)", type="positive_int",
                                      metavar="M", help="pp: micro-batches per batch (default 2 x pp)")
    schedule: str | None = option(None, group="layout options (tp, pp, fsdp)", choices=SCHEDULES,
                                  help="pp: gpipe, 1f1b (default), or with several stages per rank "
                                       "interleaved-1f1b, interleaved-zb (zero bubble) or zbv (zero bubble, V shape)")
    virtual_stages: int | None = option(None, group="layout options (tp, pp, fsdp)", type="positive_int",
                                        metavar="V", help="pp: stages per rank for the interleaved schedules "
                                        "(default 2; zbv: exactly 2); alone it means --schedule interleaved-1f1b")
    ds_config: dict | None = option(None, group="zero options", applies=ZERO_NAMES, type="json_file", compare=False,
                                    metavar="FILE", help="start from this DeepSpeed JSON")
    # every N optimizer steps, save a checkpoint to checkpoint_dir (nbtool.rank.checkpoint)
    checkpoint_every: int | None = option(None, group="checkpoint options", type="positive_int", metavar="N",
                                          help="save a checkpoint (strategy.save) every N optimizer steps")
    checkpoint_dir: str | None = option(None, group="checkpoint options", metavar="DIR",
                                        help="where --checkpoint-every saves (default: ./checkpoints)")
    # "" or a directory for the files; None: off (nbtool.rank.memory_timeline)
    memory_timeline: str | None = option(
        None, group="recording options", nargs="?", const="", metavar="DIR", compare=False,
        help="record every rank's tensor memory by category (torch.profiler's memory profile; slower steps, "
             "and an analysis after the cell) and plot it under the cell; with DIR also write torch's memory-timeline JSON and, on "
             "CUDA ranks, the allocator snapshot for pytorch.org/memory_viz")
    # None: TIMELINE_STEPS_DEFAULT; later steps run without the profiler's bookkeeping (nbtool.rank.memory_timeline)
    timeline_steps: int | None = option(
        None, group="recording options", type="positive_int", metavar="N", compare=False,
        help=f"--memory-timeline: record the cell's first N optimizer steps (default {TIMELINE_STEPS_DEFAULT}); "
             "later steps run at full speed, and the analysis after the cell grows with N")

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

    @classmethod
    def from_dict(cls, d: dict) -> "StrategySpec":
        """The spec back from as_dict's JSON (where the class-list options became lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


OPTION_FIELDS = tuple(f for f in fields(StrategySpec) if f.metadata.get("option"))


def flag_name(f) -> str:
    """The option's own name: ``--grad-accum`` (an "off" option is written ``--no-`` + it when set)."""
    return "--" + f.name.replace("_", "-")


def flag_of(f) -> str:
    """The option's name on a %%distributed line, as a user writes it when it is set."""
    name = flag_name(f)
    return "--no-" + name[2:] if f.metadata["kind"] == "off" else name


def bucket_element_bytes(precision: str) -> int:
    """Bytes of one element of DeepSpeed's reduce and all-gather buckets: it counts both in elements of the
    gradient and parameter dtype, 16-bit under bf16 / fp16."""
    return 2 if precision in ("bf16", "fp16") else 4


def line_of(spec: StrategySpec) -> str:
    """The ``%%distributed`` line (after the magic's name) that asks for ``spec``: its strategy word and
    every option that differs from the default, as a user writes it. ``--ds-config``'s file cannot be
    named from its contents and is left out."""
    words = [spec.name]
    for f in OPTION_FIELDS:
        value = getattr(spec, f.name)
        if f.name == "ds_config" or value == f.default:
            continue
        kind = f.metadata["kind"]
        if kind == "both":
            words.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        elif kind != "value" or value == f.metadata["argparse"].get("const", object()):  # a switch, or no argument
            words.append(flag_of(f))
        else:
            text = ",".join(value) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else value
            words.append(f"{flag_of(f)} {text}")
    return " ".join(words)


def given(spec: StrategySpec, f) -> bool:
    """True when the line set this option (its value differs from the field's default)."""
    return getattr(spec, f.name) != f.default


@dataclass(frozen=True)
class ParallelDims:
    """A parallel layout: data x tensor x pipeline sizes (torchtitan's name), with world = dp * tp * pp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __iter__(self):  # dp, tp, pp = dims
        return iter((self.dp, self.tp, self.pp))

    @classmethod
    def resolve(cls, spec: StrategySpec, world_size: int) -> "ParallelDims":
        """The layout ``spec`` asks for on ``world_size`` ranks, checked with the arithmetic in the message.

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
            prod = math.prod(fixed.values())
            if world_size % prod:
                given_ = " * ".join(f"{k}({v})" for k, v in fixed.items())
                raise SpecError(f"{given_} = {prod} does not divide world_size({world_size}); "
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
        return cls(dp, tp, pp)


def hsdp_dims(spec: StrategySpec, world_size: int) -> tuple[int, int] | None:
    """(replicas, shard size) of ``fsdp --dp-replicate R --dp-shard S``, checked; None without either."""
    r, sh = spec.dp_replicate, spec.dp_shard
    if r is None and sh is None:
        return None
    if (spec.tp or 1) > 1 or (spec.pp or 1) > 1:
        raise SpecError("--dp-replicate/--dp-shard with --tp/--pp: nbtool builds hybrid sharding on plain fsdp "
                        "only; drop --tp/--pp, or use fsdp --tp T --dp D (FSDP over dp, TP inside)")
    if spec.dp is not None:
        raise SpecError(f"--dp {spec.dp} with --dp-replicate/--dp-shard: hybrid sharding's data-parallel size "
                        "is R x S; drop --dp")
    for flag, v in (("--dp-replicate", r), ("--dp-shard", sh)):
        if v is not None and world_size % v:
            raise SpecError(f"{flag} {v} does not divide world_size({world_size})")
    r, sh = r or world_size // sh, sh or world_size // r
    if r * sh != world_size:
        raise SpecError(f"dp_replicate({r}) x dp_shard({sh}) = {r * sh} != world_size({world_size}); "
                        f"hybrid sharding uses every rank once: R x S = {world_size}")
    return r, sh


def _refuse_inapplicable(spec: StrategySpec, names: tuple[str, ...] | None = None) -> None:
    """Options given on the line that the strategy does not take (the table's ``applies``)."""
    for f in (f for f in OPTION_FIELDS if names is None or f.name in names):
        allowed = f.metadata["applies"]
        if spec.name not in allowed and given(spec, f):
            fix = f.metadata["refuse"] or f"it applies to {', '.join(allowed)}"
            raise SpecError(f"{flag_of(f)} does not apply to {spec.name}; {fix}")


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
    if spec.reduce_every_micro_batch and spec.grad_accum < 2:
        raise SpecError("--reduce-every-micro-batch changes how --grad-accum's micro-batches add up their "
                        "gradients; it needs --grad-accum N >= 2")
    if spec.timeline_steps is not None and spec.memory_timeline is None:
        raise SpecError(f"--timeline-steps {spec.timeline_steps} needs --memory-timeline (it bounds what that records)")
    if spec.checkpoint_dir is not None and spec.checkpoint_every is None:
        raise SpecError(f"--checkpoint-dir {spec.checkpoint_dir!r} needs --checkpoint-every N (optimizer steps)")
    _refuse_inapplicable(spec)
    if world_size is not None:
        hsdp_dims(spec, world_size)
    both = sorted(set(spec.wrap) & set(spec.replicate))
    if both:
        raise SpecError(f"{', '.join(both)} in both --wrap and --replicate: a module is sharded or replicated; "
                        "name each class once")
    if spec.replicate and spec.is_mesh:
        raise SpecError("--replicate with --tp/--pp: nbtool replicates modules under plain fsdp only; "
                        "drop --tp/--pp or --replicate")
    kind = (compression(spec) or ("",))[0]
    if kind == "bf16" and not (backend == "nccl" and device_kind == "cuda"):
        raise SpecError("--compress bf16: torch's bf16_compress_hook runs only on CUDA ranks over nccl "
                        "(DDP checks it); use --compress fp16 here")
    if kind == "powersgd" and device_kind == "cpu":
        raise SpecError(f"--compress {spec.compress}: torch 2.13's powerSGD_hook killed CPU ranks over gloo "
                        "(a segfault while computing its P/Q factors) in nbtool's tests; it is for CUDA ranks "
                        "over nccl; use --compress fp16 here")
    if spec.offload is not None:
        if spec.offload not in OFFLOADS:
            raise SpecError(f"--offload {spec.offload!r}; allowed: {', '.join(OFFLOADS)}")
        if n == "fsdp" and spec.offload != "both":
            raise SpecError(f"fsdp --offload {spec.offload}: FSDP's CPUOffloadPolicy moves parameters, gradients and "
                            "optimizer state together; use --offload both (or zero2/zero3 to offload one part)")
        if n in ("zero1", "zero2") and spec.offload in ("params", "both"):
            raise SpecError(f"{n} --offload {spec.offload}: DeepSpeed offloads parameters only in ZeRO stage 3; "
                            "use zero3, or --offload optimizer")
    if spec.precision == "fp16":
        if n == "fsdp":
            raise SpecError("fsdp --precision fp16: nbtool wires no loss scaler into FSDP2, and fp16 without one "
                            "underflows; use --precision bf16 (or ddp / zero* with fp16 on GPUs)")
        if spec.is_zero and device_kind == "cpu":
            raise SpecError(f"{n} --precision fp16 on CPU ranks: DeepSpeed's CPU accelerator has no fp16 loss "
                            "scaling; use --precision bf16")
    if spec.is_zero and backend not in (None, "gloo", "nccl"):
        raise SpecError(f"{n} needs a gloo or nccl process group; this cluster uses {backend}")
    if spec.is_zero and spec.ds_config is not None:
        stage = (spec.ds_config.get("zero_optimization") or {}).get("stage")
        if stage not in (None, spec.stage):
            raise SpecError(f"--ds-config has zero_optimization.stage {stage} but the strategy is {n}; "
                            f"use %%distributed zero{stage}, or change the file")


def _validate_layout(spec: StrategySpec, world_size: int | None) -> None:
    """The tp/pp/sp options: which strategies take them, and the layout arithmetic."""
    n = spec.name
    _refuse_inapplicable(spec, ("dp", "tp", "pp"))
    if world_size is not None and n in LAYOUT_NAMES:
        _, tp, pp = ParallelDims.resolve(spec, world_size)
    else:
        tp, pp = spec.tp or (2 if n == "tp" else 1), spec.pp or (2 if n == "pp" else 1)
    if spec.sp and tp < 2:
        raise SpecError(f"--sp splits activations along the sequence inside a tensor-parallel group; "
                        f"it needs tp >= 2 (got tp({tp})): use %%distributed tp --tp 2 --sp")
    if pp < 2:
        for opt, given in (("--microbatches", spec.microbatches), ("--schedule", spec.schedule),
                           ("--virtual-stages", spec.virtual_stages)):
            if given is not None:
                raise SpecError(f"{opt} applies to pipeline parallelism; it needs pp >= 2 (got pp({pp})): "
                                f"use %%distributed pp --pp 2 {opt} ...")
    else:
        if spec.schedule is not None and spec.schedule not in SCHEDULES:
            raise SpecError(f"--schedule {spec.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if spec.microbatches is not None and spec.microbatches < pp:
            raise SpecError(f"--microbatches {spec.microbatches} is fewer than the pp({pp}) stages; "
                            f"every stage needs work: use --microbatches >= {pp}")
        _validate_schedule(spec, pp)
        if spec.grad_accum > 1:
            raise SpecError("--grad-accum with pipeline parallelism: the micro-batches already accumulate "
                            "gradients within a step; use --microbatches M")
    if not spec.is_mesh:
        return
    if spec.compile and tp > 1:
        raise SpecError(f"--compile with tp({tp}): the tensor-parallel collectives would be traced into the compiled "
                        "graph, where nbtool's recorder does not see them (bytes and times would read low); "
                        "drop --compile, or compile with ddp, fsdp, zero* or pp")
    schedule = pipeline_schedule(spec)[0]
    if spec.compile and pp > 1 and schedule in ("interleaved-zb", "zbv"):
        raise SpecError(f"--compile with --schedule {schedule}: the zero-bubble schedules split "
                        "backward into input and weight gradients, which torch.compile does not support "
                        "(torch's pipelining refuses it); use --schedule interleaved-1f1b or 1f1b")
    if spec.offload is not None:
        raise SpecError(f"--offload with tp({tp}) / pp({pp}): nbtool offloads only plain fsdp and zero*; "
                        "drop --offload, or use fsdp --offload without --tp/--pp")
    if spec.precision == "fp16" and n != "fsdp":
        raise SpecError(f"{n} --precision fp16: nbtool wires no loss scaler into tp or pp, and fp16 without "
                        "one underflows; use --precision bf16 (autocast, fp32 weights)")


def _validate_schedule(spec: StrategySpec, pp: int) -> None:
    """Stages per rank against the schedule, and torch's rule for the interleaved ones' micro-batches."""
    schedule, v = pipeline_schedule(spec)
    if schedule not in MULTI_STAGE and v > 1:
        raise SpecError(f"--virtual-stages {v} with --schedule {schedule}: {schedule} runs one stage per rank; "
                        f"use --schedule {' or '.join(MULTI_STAGE)}")
    if schedule in MULTI_STAGE and v < 2:
        raise SpecError(f"--schedule {schedule} runs several stages per rank; it needs --virtual-stages >= 2")
    if schedule == "zbv" and v != 2:
        raise SpecError(f"--schedule zbv --virtual-stages {v}: ZB-V runs exactly 2 stages per rank (a V "
                        "shape); use --virtual-stages 2 or --schedule interleaved-zb")
    if v > 1 and spec.name == "fsdp":
        raise SpecError(f"fsdp --pp {pp} --virtual-stages {v}: nbtool runs several stages per rank without FSDP "
                        f"only; use pp --pp {pp} --virtual-stages {v} (or tp --pp), or one stage per rank")
    m = spec.microbatches or 2 * pp
    rounds = max(1, m // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zb") and m % rounds:
        raise SpecError(f"--microbatches {m} with {schedule} on pp({pp}): torch runs the micro-batches in "
                        f"rounds of pp, so M must be a multiple of max(1, M // pp) = {rounds}; "
                        f"use --microbatches {rounds * pp}")


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
    for key in ("overlap_comm", "contiguous_gradients"):
        if getattr(spec, key) is not None:
            zero[key] = getattr(spec, key)
    per_element = bucket_element_bytes(spec.precision)
    for key, mb in (("reduce_bucket_size", spec.reduce_bucket_mb), ("allgather_bucket_size", spec.allgather_bucket_mb)):
        if mb is not None:
            zero[key] = int(mb * 2**20) // per_element
    for key, parts in (("offload_optimizer", ("optimizer", "both")), ("offload_param", ("params", "both"))):
        if spec.offload in parts:
            zero[key] = {"device": "cpu", "pin_memory": False}
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
