"""The device mesh (data, fsdp, tensor) and how a model is laid over it.

- tensor > 1: DTensor `parallelize_module` with a plan made from wildcard rules on parameter
  names (`"*.q_proj.weight": colwise`), matched with fnmatch against each module's weight.
- fsdp > 1: FSDP2 `fully_shard` per transformer layer, then the root (HSDP when data > 1 too).
- data > 1 alone: DDP.
Activation checkpointing wraps whole layers, before any sharding.
"""
from __future__ import annotations

import fnmatch
import os

import torch
import torch.distributed as dist

from .config import ConfigError

__all__ = ["world", "init_distributed", "mesh_shape", "build_mesh", "layers_of", "apply_activation_checkpointing",
           "tensor_plan", "parallelize"]

# Megatron-style tensor parallelism for Llama-like blocks: used when mesh.rules is empty.
DEFAULT_RULES = {
    "*.q_proj.weight": "colwise", "*.k_proj.weight": "colwise", "*.v_proj.weight": "colwise",
    "*.o_proj.weight": "rowwise",
    "*.gate_proj.weight": "colwise", "*.up_proj.weight": "colwise", "*.down_proj.weight": "rowwise",
}


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: int = 600) -> None:
    import datetime
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(timeout=datetime.timedelta(seconds=timeout_s))  # cpu:gloo,tpu:tpu_dist


def mesh_shape(cfg, world_size: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor); data=-1 takes what the world size leaves."""
    m = cfg.mesh
    inner = m.fsdp * m.tensor
    data = m.data if m.data != -1 else world_size // inner
    if data < 1 or data * inner != world_size:
        raise ConfigError(f"config key 'mesh': data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} does not make the "
                          f"world size {world_size}")
    return data, m.fsdp, m.tensor


def build_mesh(shape):
    if shape == (1, 1, 1):
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("tpu", shape, mesh_dim_names=("data", "fsdp", "tensor"))


def layers_of(model) -> list[torch.nn.Module]:
    """The repeated blocks: modules of a class the model lists in _no_split_modules, else the longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def apply_activation_checkpointing(model, spec: str) -> int:
    """spec: none, all, every:N. HF layers recompute through their own switch (names unchanged);
    others are wrapped in checkpoint_wrapper. Returns the number of layers checkpointed."""
    if spec == "none":
        return 0
    every = 1 if spec == "all" else int(spec.split(":")[1])
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    count = 0
    for i, layer in enumerate(layers_of(model)):
        if i % every:
            continue
        if hasattr(layer, "gradient_checkpointing"):  # transformers' GradientCheckpointingLayer
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        else:
            inner_forward = layer.forward
            layer.forward = lambda *a, _f=inner_forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        count += 1
    if count == 0:
        raise ConfigError("config key 'model.activation_checkpointing': the model has no layers to checkpoint")
    return count


def tensor_plan(model, rules: dict) -> dict:
    """{module name: ParallelStyle} for the Linear/Embedding modules whose weight name matches a rule
    (first matching rule wins; a rule may name the module itself)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan, used = {}, set()
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        for pattern, style in rules.items():
            if fnmatch.fnmatchcase(name + ".weight", pattern) or fnmatch.fnmatchcase(name, pattern):
                used.add(pattern)
                if style != "replicate":
                    plan[name] = styles[style]()
                break
    unused = [p for p in rules if p not in used]
    if unused:
        raise ConfigError(f"config key 'mesh.rules.{unused[0]}': matches no Linear or Embedding weight of the model")
    return plan


def _check_heads(model, tp: int) -> None:
    c = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(c, key, None)
        if n is not None and n % tp:
            raise ConfigError(f"config key 'mesh.tensor': {tp} does not divide model.config.{key}={n}")


def parallelize(model, mesh, rules: dict):
    """Lays `model` (on the meta device) over `mesh`; returns the module to train."""
    data, fsdp, tp = mesh.mesh.shape
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module
        _check_heads(model, tp)
        parallelize_module(model, mesh["tensor"], tensor_plan(model, rules or DEFAULT_RULES))
    if fsdp > 1:
        from torch.distributed.fsdp import fully_shard
        dp_mesh = mesh["data", "fsdp"] if data > 1 else mesh["fsdp"]
        for layer in layers_of(model):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model
