"""``strategy.dataloader``: each data-parallel replica reads its own shard, batches land on the rank's device."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

class _EpochLoader:
    """A DataLoader over a DistributedSampler that advances the epoch itself."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, device, seen: dict | None = None):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.seen = {} if seen is None else seen  # the first batch's samples and tokens (the planner's inputs)
        self.epoch = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            if not self.seen:
                self.seen.update(_batch_size(batch))
            yield _to_device(batch, self.device)


def _batch_size(batch) -> dict:
    """Samples in the batch and, where its first tensor holds integer ids, tokens (its elements)."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    if not torch.is_tensor(first) or first.dim() == 0:
        return {}
    ids = not first.is_floating_point() and not first.is_complex()
    return {"samples": first.shape[0], "tokens": first.numel() if ids else None,
            "seq": first.shape[1] if ids and first.dim() == 2 else None}


def _to_device(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
