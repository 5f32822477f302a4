"""torch.tpu.distributed: TorchTPU's distributed helpers on torch_pjrt's tpu_dist backend.

- spmd_safe(func): func runs between two torch_pjrt.sync() calls, so the ops before and after it are not
  fused into its graphs (TorchTPU synchronizes its tensors the same way). TorchTPU also fuses the collectives
  inside such a function with the ops around them; tpu_dist runs a collective where it is called (staged
  through Gloo), with or without the decorator.
- topology_aware_mesh(mesh_shape): the world's ranks in the mesh's shape, in rank order. torch_pjrt's
  devices have no TPU interconnect topology to follow, so every layout is as near as any other.
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["spmd_safe", "topology_aware_mesh"]


def spmd_safe(func):
    """Marks func as run identically on every rank; its inputs' and outputs' pending ops run before and after."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        import torch_pjrt

        torch_pjrt.sync()
        result = func(*args, **kwargs)
        torch_pjrt.sync()
        return result

    return wrapper


def topology_aware_mesh(mesh_shape, *, dcn_mesh_shape=None, allow_split_physical_axes=False,
                        contiguous_submeshes=False):
    """An int64 tensor of global ranks of shape mesh_shape (whose product must be the world size).

    dcn_mesh_shape says how the axes split across slices: torch_pjrt's world is one slice, so its product
    must be 1. allow_split_physical_axes and contiguous_submeshes concern physical TPU axes and are ignored.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("topology_aware_mesh needs torch.distributed initialized (dist.init_process_group())")
    mesh_shape = tuple(int(s) for s in mesh_shape)
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} positions, the world has {world} "
                         "ranks")
    if dcn_mesh_shape is not None:
        dcn_mesh_shape = tuple(int(s) for s in dcn_mesh_shape)
        if len(dcn_mesh_shape) != len(mesh_shape) or math.prod(dcn_mesh_shape) != 1:
            raise ValueError(f"dcn_mesh_shape {dcn_mesh_shape}: the job is one slice, so it must be "
                             f"{(1,) * len(mesh_shape)}")
    return torch.arange(world, dtype=torch.int64).reshape(mesh_shape)
