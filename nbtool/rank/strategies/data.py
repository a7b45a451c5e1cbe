"""``strategy.dataloader``: each data-parallel replica reads its own shard, batches land on the rank's device."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

class _EpochLoader:
    """A DataLoader over a DistributedSampler that advances the epoch itself."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, device):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.epoch = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            yield _to_device(batch, self.device)


def _to_device(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
