"""The memory ledger's counting: bytes of each category a rank owns, each storage counted once."""
from __future__ import annotations

from collections import Counter

import torch

class Tally:
    """Sums tensor bytes per category, counting each element of a storage once.

    Tensors that view the same storage (parameters viewing a flat buffer,
    gradients viewing a bucket) are counted by the byte ranges they cover, so
    nothing is counted twice; slack in a buffer that no listed tensor views
    is not counted (allocator and RSS figures include it).
    """

    def __init__(self, only: tuple[str, ...] | None = None):
        self.bytes: Counter = Counter()
        self.offloaded: Counter = Counter()
        self.only = only  # count just these categories (the rest cost nothing)
        self._covered: dict = {}  # storage key -> sorted, merged [start, end) byte ranges

    def add(self, category: str, tensor, offloaded: bool = False) -> None:
        if tensor is None or (self.only is not None and category not in self.only):
            return
        if hasattr(tensor, "to_local"):  # DTensor: the local shard is what this rank holds
            tensor = tensor.to_local()
        if tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        start = tensor.storage_offset() * tensor.element_size()
        # runs twice per optimizer step: the device object, not its (slow) str(), keys the storage
        new = _claim(self._covered.setdefault((storage.data_ptr(), tensor.device), []),
                     start, start + tensor.numel() * tensor.element_size())
        self.bytes[category] += new
        if offloaded:
            self.offloaded[category] += new

    def add_optimizer_state(self, state, offloaded: bool = False) -> None:
        for per_param in state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    self.add("optimizer_state" if value.dim() > 0 else "other", value, offloaded)


def _claim(ranges: list, start: int, end: int) -> int:
    """Add [start, end) to the merged ``ranges``; return how many bytes were new."""
    covered = sum(max(0, min(end, e) - max(start, s)) for s, e in ranges)
    merged = [start, end]
    keep = []
    for s, e in ranges:
        if e < merged[0] or s > merged[1]:
            keep.append((s, e))
        else:
            merged = [min(s, merged[0]), max(e, merged[1])]
    keep.append(tuple(merged))
    ranges[:] = sorted(keep)
    return (end - start) - covered
