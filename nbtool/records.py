"""Records that ranks produce and the kernel and widgets consume.

Plain dataclasses with a schema version; nothing here imports torch or
display code, so both sides (and saved files) can use them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1

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
