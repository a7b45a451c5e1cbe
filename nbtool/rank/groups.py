"""Engine side: the device meshes and sub-groups of this engine's life, made once each.

Creating a mesh or a group is collective (every rank of the world calls it),
and DeepSpeed caches groups it has seen, so nbtool never destroys and remakes
them: one registry, keyed by what the group spans, for every strategy and
%commbench.
"""
from __future__ import annotations

_made: dict = {}


def _once(key: tuple, make):
    if key not in _made:
        _made[key] = make()
    return _made[key]


def world_mesh(device_type: str):
    """A 1-D mesh over the world (it reuses the default group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return _once(("world", device_type), lambda: init_device_mesh(device_type, (dist.get_world_size(),)))


def layout_mesh(device_type: str, dims):
    """The ("pp", "dp", "tp") mesh of a ParallelDims layout (tp innermost, as in torchtitan)."""
    from torch.distributed.device_mesh import init_device_mesh

    return _once(("layout", device_type, dims.pp, dims.dp, dims.tp), lambda: init_device_mesh(
        device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp")))


def hsdp_mesh(device_type: str, replicas: int, shard: int):
    """The ("dp_replicate", "dp_shard") mesh of hybrid sharding: shard groups of neighbouring ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return _once(("hsdp", device_type, replicas, shard), lambda: init_device_mesh(
        device_type, (replicas, shard), mesh_dim_names=("dp_replicate", "dp_shard")))


def subgroup(ranks: tuple[int, ...]):
    """A process group over ``ranks`` (None: the world itself)."""
    import torch.distributed as dist

    if len(ranks) == dist.get_world_size():
        return None
    return _once(("group", tuple(ranks)), lambda: dist.new_group(list(ranks)))
