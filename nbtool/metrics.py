"""The record schema: what ranks produce and the kernel and widgets consume.

Plain dataclasses with a schema version, their JSON and CSV export, and
nothing else (no torch, no display code), so ranks, the kernel, widgets and
saved files all share them. ``load(path)`` reads an export back.

Times are ``time.time()`` seconds on the rank's own clock (ranks on one host
share it; across hosts they are only as aligned as the hosts' clocks).
"""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field, fields

SCHEMA_VERSION = 5  # 2: the run description is a RunDescription; 3: CommWait records, CommRecord.asynchronous;
# 4: MemoryTimeline records; 5: PipelineStep.virtual

LEDGER_CATEGORIES = ("params", "grads", "master_params", "optimizer_state", "other")


@dataclass
class MemoryLedger:
    """Bytes of model state one rank holds, counted from its own tensors.

    Not RSS and not allocator figures: each category sums the storages of the
    tensors that rank owns (local shards, DeepSpeed partitions, fp32 master
    copies, ``optimizer.state``), each storage counted once even when several
    tensors view it. ``offloaded`` is the part of each category that an
    offload policy keeps in host memory.

    - params: the model's parameters as this rank stores them (full replica,
      local shard, or DeepSpeed partition plus persistent small params)
    - grads: gradients (or gradient partitions / buckets) held for the step
    - master_params: fp32 copies an optimizer wrapper keeps (DeepSpeed)
    - optimizer_state: optimizer.state tensors (Adam's exp_avg, exp_avg_sq)
    - other: optimizer scalars such as Adam's per-parameter step counters
    """

    rank: int
    strategy: str
    when: str  # "now", or "step N" (gradients as step N began, the rest after it)
    params: int = 0
    grads: int = 0
    master_params: int = 0
    optimizer_state: int = 0
    other: int = 0
    offloaded: dict = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in LEDGER_CATEGORIES)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d

    def __str__(self) -> str:
        parts = ", ".join(f"{c} {format_bytes(getattr(self, c))}" for c in LEDGER_CATEGORIES if getattr(self, c))
        off = sum(self.offloaded.values())
        tail = f" ({format_bytes(off)} offloaded to host)" if off else ""
        return f"rank {self.rank} {self.strategy} [{self.when}]: {parts}; total {format_bytes(self.total)}{tail}"


def format_bytes(n: float) -> str:
    """Binary units, 3 significant figures: 512 B, 1.50 KiB, 13.1 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.3g} {unit}" if n >= 10 else f"{n:.2f} {unit}"


@dataclass
class CommRecord:
    """One collective a rank issued.

    ``size_bytes`` is S as nccl-tests defines it for the op (see
    nbtool.collectives); ``bus_bytes`` = S * bus factor. ``clock`` says how
    ``seconds`` was measured: "wall" (issue to completion on the host clock:
    the call's return for blocking ops, the work's future for async ones,
    the caller's wait() for gloo send/recv, which have no future) or
    "cuda_event" (device time: CUDA events on the issuing stream for blocking
    ops, NCCL's own events around its kernel for async ones).
    ``asynchronous``: issued with ``async_op=True`` (or isend/irecv), so the
    caller ran on while it was in flight; how long it then waited for it is in
    CommWait records.
    """

    rank: int
    seq: int  # this rank's n-th collective in the run (the same n is the same collective on every rank)
    op: str
    size_bytes: int
    bus_bytes: float
    group_size: int
    dtype: str
    t_issue: float
    seconds: float
    clock: str
    step: int  # optimizer steps completed when it was issued
    algbw: float = 0.0  # bytes / s
    busbw: float = 0.0
    asynchronous: bool = False
    schema: int = SCHEMA_VERSION


@dataclass
class CommWait:
    """The training thread of ``rank`` blocked in ``Work.wait()`` on async collective ``seq``, from
    wall time ``t`` for ``seconds``: the exposed part of an async collective (a blocking one is
    exposed for all of its ``seconds``)."""

    rank: int
    seq: int
    t: float
    seconds: float
    schema: int = SCHEMA_VERSION


@dataclass
class MemorySample:
    """Memory of one rank at one moment, each figure labelled by what it measures.

    - rss / peak_rss: the process's resident set size now / its high-water
      mark (OS figures: include libraries, allocator caches, buffers)
    - cuda_allocated / cuda_reserved / cuda_peak: the CUDA caching
      allocator's counters (None on CPU ranks); cuda_peak is the high-water
      mark since the run began, or since the first optimizer step ended
      where cuda_peak_since is 1 (the recorder resets it there, so the set-up
      and first step's peak and that of steps 2..N are both measured)
    - cuda_workspace: the part of cuda_allocated that is cuBLAS's workspaces,
      measured by releasing them when the run ends (last sample of a run only)
    - driver_used: the bytes the driver (NVML) attributes to this process on
      its GPU; minus cuda_reserved it is the memory outside PyTorch's
      allocator (CUDA context, NCCL buffers, other libraries). None without
      nvidia-ml-py or a GPU
    - ledger: bytes of model state the rank owns by category (MemoryLedger
      fields), only in samples taken at optimizer steps
    """

    rank: int
    t: float
    step: int
    source: str  # "interval" (sampler thread) or "step" (at an optimizer step)
    rss: int
    peak_rss: int | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    cuda_peak_since: int = 0
    cuda_workspace: int | None = None
    driver_used: int | None = None
    ledger: dict | None = None
    schema: int = SCHEMA_VERSION


@dataclass
class MemoryTimeline:
    """One rank's tensor memory over a ``--memory-timeline`` cell, by category.

    Tracked tensor bytes (torch.profiler's memory profile: every tensor
    allocated and freed while the cell ran, categorised by what the profiler
    saw it used as), not allocator or RSS figures. ``times`` are seconds since
    ``t0``, the wall-clock time of the first memory event; ``bytes`` holds one list per category in
    ``categories`` order, aligned with ``times`` (downsampled, keeping each
    interval's highest total, so the peak survives). ``files`` lists what was
    written for other tools (torch's memory-timeline JSON; on CUDA ranks the
    allocator-history snapshot pickle for pytorch.org/memory_viz).
    """

    rank: int
    device: str
    t0: float  # time.time() of the first memory event (the profiler's clock)
    times: list = field(default_factory=list)
    categories: list = field(default_factory=list)  # torch.profiler's Category names, lower case; "unknown"
    bytes: list = field(default_factory=list)
    files: list = field(default_factory=list)
    events: int = 0  # memory events the profiler saw (before downsampling)
    steps: int = 0  # the optimizer steps it covers when the cell ran more (--timeline-steps); 0: the whole cell
    note: str = ""  # what the timeline leaves out: the categories (torch could not work them out), later steps
    schema: int = SCHEMA_VERSION

    def totals(self) -> list:
        return [sum(c[i] for c in self.bytes) for i in range(len(self.times))]

    def at(self, i: int) -> dict:
        """{category: bytes} at point ``i`` (-1: the end of the cell)."""
        return {c: b[i] for c, b in zip(self.categories, self.bytes)}

    def peak(self) -> tuple[float, dict]:
        """(seconds, {category: bytes}) at the highest total."""
        totals = self.totals()
        i = max(range(len(totals)), key=totals.__getitem__) if totals else -1
        return (self.times[i] if totals else 0.0), (self.at(i) if totals else {})


@dataclass
class StepMarker:
    """An optimizer step completed on a rank (at an accumulation boundary)."""

    rank: int
    step: int  # 1 for the first step
    t: float
    schema: int = SCHEMA_VERSION


@dataclass
class ScalarRecord:
    """Scalars from ``strategy.log(...)`` (loss, lr ...)."""

    rank: int
    step: int
    t: float
    values: dict
    schema: int = SCHEMA_VERSION


@dataclass
class PipelineStep:
    """One pipeline-parallel training step on one rank: how long its stage computed and idled.

    ``step_s`` is the wall time of the schedule's step (forward and backward
    of every micro-batch); ``compute_s`` the time spent in the stage's own
    forward and backward chunks, loss (last stage) and gradient scaling. The
    rest, ``idle_s``, is the bubble: waiting for the neighbouring stages, plus
    sending, receiving and the schedule's bookkeeping. ``stage`` is the rank's
    place in the pipeline group; with ``virtual`` > 1 it runs that many
    stages. ``bubble_theory`` is spec.bubble_fraction's, for equal stages and
    free communication ((stages - 1) / (microbatches + stages - 1) for GPipe
    and 1F1B).
    """

    rank: int
    step: int  # the optimizer step this schedule step belongs to (1 for the first)
    t: float
    stage: int
    stages: int
    microbatches: int
    schedule: str
    step_s: float
    compute_s: float
    virtual: int = 1  # stages this rank runs (the interleaved schedules' V)
    schema: int = SCHEMA_VERSION

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)

    @property
    def bubble_theory(self) -> float:
        from .spec import bubble_fraction

        return bubble_fraction(self.stages, self.microbatches, self.schedule, self.virtual)


# RunRecords list -> record type (JSON keys), and the CSV "kind" of each
KINDS = {"comms": CommRecord, "memory": MemorySample, "steps": StepMarker, "scalars": ScalarRecord,
         "pipeline": PipelineStep, "waits": CommWait, "timelines": MemoryTimeline}
CSV_KINDS = {"comm": "comms", "memory": "memory", "step": "steps", "scalar": "scalars", "pipeline": "pipeline",
             "wait": "waits", "timeline": "timelines"}


@dataclass
class RunDescription:
    """What a run was: the strategy's own ``describe()`` (for people), and what the planner reads."""

    details: dict = field(default_factory=dict)  # strategy.describe(): wrapper, sharding, plan, units ...
    param_numels: list = field(default_factory=list)  # elements of each parameter of the plain model
    precision: str = "fp32"
    reshard_after_forward: bool = True  # fsdp's option
    dims: tuple | None = None  # (dp, tp, pp) of a tp / pp / fsdp x tp layout; None for the others
    model_shape: dict = field(default_factory=dict)  # layers, hidden, heads, vocab, largest_layer (ModelShape)
    batch: dict = field(default_factory=dict)  # the first batch on rank 0: samples, tokens, seq (ids only)
    spec: dict = field(default_factory=dict)  # the StrategySpec's fields (nbtool.spec), for the planner and advice
    compile: list = field(default_factory=list)  # [step, seconds] torch.compile spent (--compile), rank 0's
    # CPU ranks: rank 0's [fp32, bf16] FLOP/s of one Linear's forward and backward (nbtool.rank.matmul_probe)
    matmul_flops: list | None = None


@dataclass
class RunRecords:
    """Everything recorded for one cell run."""

    name: str
    strategy: str | None
    world_size: int
    t_start: float
    t_end: float | None = None
    description: RunDescription = field(default_factory=RunDescription)
    comms: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    scalars: list = field(default_factory=list)
    pipeline: list = field(default_factory=list)  # PipelineStep records (pp runs only)
    waits: list = field(default_factory=list)  # CommWait records
    timelines: list = field(default_factory=list)  # MemoryTimeline records (--memory-timeline runs)
    schema: int = SCHEMA_VERSION

    def add(self, records) -> None:
        lists = {kind: getattr(self, key) for key, kind in KINDS.items()}
        for r in records:
            lists[type(r)].append(r)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "strategy", "world_size", "t_start", "t_end", "schema")}
        d["description"] = asdict(self.description)
        for key in KINDS:
            d[key] = [asdict(r) for r in getattr(self, key)]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RunRecords":
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"record schema {d.get('schema')} is not {SCHEMA_VERSION} (this nbtool)")
        run = cls(**{k: d[k] for k in ("name", "strategy", "world_size", "t_start", "t_end")},
                  description=_record(RunDescription, d.get("description", {})))
        if run.description.dims is not None:
            run.description.dims = tuple(run.description.dims)
        for key, kind in KINDS.items():
            getattr(run, key).extend(_record(kind, r) for r in d.get(key, []))
        return run


def _record(kind, values: dict):
    """``kind(**values)``, or a ValueError naming the fields this nbtool's ``kind`` lacks (a file written
    by another build under the same schema number) instead of dataclass's bare TypeError."""
    if unknown := sorted(set(values) - {f.name for f in fields(kind)}):
        raise ValueError(f"{kind.__name__} field(s) {', '.join(unknown)} unknown to this nbtool (schema "
                         f"{SCHEMA_VERSION}): the file was written by another nbtool build")
    return kind(**values)


def export(run: RunRecords, path: str) -> None:
    """Write ``run`` as JSON (``.json``) or as CSV (``.csv``: one row per record, a ``kind`` column)."""
    if str(path).endswith(".csv"):
        rows = [(kind, asdict(r)) for kind, key in CSV_KINDS.items() for r in getattr(run, key)]
        columns = ["kind"] + sorted({k for _, r in rows for k in r})
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for kind, r in rows:
                w.writerow({"kind": kind, **{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()}})
        return
    with open(path, "w") as f:
        json.dump(run.to_json(), f)


def load(path: str) -> RunRecords:
    """Read a run written by ``export`` (JSON, or CSV with the run's name taken from the file)."""
    if not str(path).endswith(".csv"):
        with open(path) as f:
            return RunRecords.from_json(json.load(f))
    run = RunRecords(name=str(path), strategy=None, world_size=0, t_start=0.0)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kind = KINDS[CSV_KINDS[row.pop("kind")]]
            names = {fl.name: fl for fl in fields(kind)}  # other kinds' columns are empty in this row
            run.add([_record(kind, {k: _from_csv(v, names[k].type) if k in names else v
                                    for k, v in row.items() if k in names or v != ""})])
    run.world_size = max((r.rank for key in KINDS for r in getattr(run, key)), default=-1) + 1
    return run


def _from_csv(value: str, typ: str):
    if value == "":
        return None
    if "dict" in typ or "list" in typ:
        return json.loads(value)
    if typ.startswith("bool"):
        return value == "True"
    if typ.startswith("int"):
        return int(value)
    if typ.startswith("float"):
        return float(value)
    return value
