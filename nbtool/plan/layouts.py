"""The layouts the planner estimates: one value per layout, with everything each table used to key on.

A Layout compares equal to its key (``"zero3-offload-optimizer"``), so records
and tests can name layouts plainly; code reads its fields, never the key's text.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Layout:
    key: str  # stable name: "ddp", "fsdp-grad-op", "zero3-offload", "tp-pp", ...
    label: str  # what the user reads
    strategy: str = ""  # the %%distributed word for data-parallel layouts ("" for tp/pp: chosen per precision)
    stage: int = 0  # ZeRO stage
    offload: str | None = None  # "optimizer" or "both" (DeepSpeed offload, --offload's values)
    reshard: bool = True  # fsdp: free gathered parameters after forward (False: grad-op sharding)
    mesh: bool = False  # tensor / pipeline parallel (Megatron-style)

    @property
    def is_zero(self) -> bool:
        return self.stage > 0

    @property
    def is_fsdp(self) -> bool:
        return self.strategy == "fsdp"

    def words(self) -> str:
        """The strategy part of its %%distributed line (data-parallel layouts)."""
        out = [self.strategy]
        if self.is_fsdp and not self.reshard:
            out.append("--no-reshard-after-forward")
        if self.offload:
            out.append(f"--offload {self.offload}")
        return " ".join(out)

    def __eq__(self, other) -> bool:
        if isinstance(other, Layout):
            return self.key == other.key
        return isinstance(other, str) and self.key == other

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return self.key

    def __repr__(self) -> str:
        return f"Layout({self.key!r})"


DDP = Layout("ddp", "DDP", "ddp")
FSDP = Layout("fsdp", "FSDP (full shard)", "fsdp")
FSDP_GRAD_OP = Layout("fsdp-grad-op", "FSDP (grad-op sharding)", "fsdp", reshard=False)
ZERO1 = Layout("zero1", "ZeRO-1", "zero1", stage=1)
ZERO2 = Layout("zero2", "ZeRO-2", "zero2", stage=2)
ZERO3 = Layout("zero3", "ZeRO-3", "zero3", stage=3)
ZERO2_OFFLOAD = Layout("zero2-offload", "ZeRO-2 + CPU offload", "zero2", stage=2, offload="optimizer")
ZERO3_OFFLOAD_OPTIMIZER = Layout("zero3-offload-optimizer", "ZeRO-3 + CPU offload (optimizer)", "zero3", stage=3,
                                 offload="optimizer")
ZERO3_OFFLOAD = Layout("zero3-offload", "ZeRO-3 + CPU offload (optimizer + params)", "zero3", stage=3,
                       offload="both")
TP = Layout("tp", "Megatron TP", mesh=True)
PP = Layout("pp", "Megatron PP", mesh=True)
TP_PP = Layout("tp-pp", "Megatron TP x PP", mesh=True)

DP_LAYOUTS = (DDP, FSDP_GRAD_OP, ZERO2, ZERO1, FSDP, ZERO3, ZERO2_OFFLOAD, ZERO3_OFFLOAD_OPTIMIZER, ZERO3_OFFLOAD)
#: simplest first: ties (within 10% of the best step time) go to the earlier one
PREFERENCE = DP_LAYOUTS[:6] + (TP, PP, TP_PP) + DP_LAYOUTS[6:]
BY_KEY = {lay.key: lay for lay in PREFERENCE}


def layout(key) -> Layout:
    """The Layout named ``key`` (a Layout passes through)."""
    if isinstance(key, Layout):
        return key
    try:
        return BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown layout {key!r}; known: {', '.join(BY_KEY)}") from None
