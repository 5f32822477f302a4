"""PyTorch's own decompositions for ops that have no C++ lowering.

An op reaches the device's boxed fallback when PyTorch has no generic kernel
for it (only CPU/CUDA ones). Where torch._decomp has a decomposition into ops
we do lower, that runs on the device instead of a round trip to the CPU. A
decomposition that cannot handle its input (returns NotImplemented, or leads
back to the same op, as refs built on prims do) runs on the CPU instead,
counted and warned like every CPU fallback.
"""
from __future__ import annotations

import collections
import threading

import torch
import torch.utils._pytree as pytree
from torch._decomp import decomposition_table

from . import _C

counts: collections.Counter = collections.Counter()  # op -> decomposed calls
_library = None
_active = threading.local()

# Data-dependent output shapes: the CPU kernel is exact and as fast.
_SKIP = {"aten::nonzero", "aten::unique", "aten::masked_select"}


def _on_cpu(op, name: str, why: str, args, kwargs):
    _C._note_cpu_fallback(name, why)
    device = next(x.device for x in pytree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor) and x.device.type == "tpu")
    to_cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.device.type == "tpu" else x
    out = op(*pytree.tree_map(to_cpu, args), **pytree.tree_map(to_cpu, kwargs))
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, out)


_accepted: set = set()  # signatures the CPU kernel accepted


def _cpu_rejects(op, args, kwargs) -> bool:
    """Whether the CPU kernel rejects a call of this signature.

    Decompositions skip checks the CPU kernels make (heaviside's dtypes,
    ...), and ATen's structured meta checks are shadowed by Python meta
    registrations; so, once per signature, the CPU kernel runs on zeros of the
    same dtypes, shapes and strides. Seeded random ops are not probed (the
    probe would draw from the CPU generator).
    """
    if torch.Tag.nondeterministic_seeded in op.tags:
        return False
    leaves = pytree.tree_leaves((args, kwargs))
    key = (op, len(leaves)) + tuple(
        (x.dtype, tuple(x.shape), tuple(x.stride()), x.device.type) if isinstance(x, torch.Tensor) else x
        for x in leaves)
    try:
        if key in _accepted:
            return False
    except TypeError:  # an unhashable argument: probe every call
        key = None
    to_zeros = lambda x: (torch.zeros_like(x, device="cpu")
                          if isinstance(x, torch.Tensor) and x.device.type == "tpu" else x)
    try:
        op(*pytree.tree_map(to_zeros, args), **pytree.tree_map(to_zeros, kwargs))
    except Exception:
        return True  # the real call on the CPU decides (its error, or its result on the real data)
    if key is not None:
        _accepted.add(key)
    return False


def _to_device(args, kwargs):
    """0-d CPU tensors join the device, as TensorIterator lets them on CUDA."""
    device = next(x.device for x in pytree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor) and x.device.type == "tpu")
    move = lambda x: (x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 0
                      else x)
    return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)


def _kernel(op, name: str, decomposition):
    def kernel(*args, **kwargs):
        active = getattr(_active, "ops", None)
        if active is None:
            active = _active.ops = set()
        if name in active:
            return _on_cpu(op, name, "its decomposition calls itself", args, kwargs)
        # A rejected call or a failing decomposition: the CPU kernel decides
        # (CPU's error type and message, or its result).
        if _cpu_rejects(op, args, kwargs):
            return _on_cpu(op, name, "the CPU kernel rejects these arguments", args, kwargs)
        dargs, dkwargs = _to_device(args, kwargs)
        active.add(name)
        try:
            out = decomposition(*dargs, **dkwargs)
        except Exception:
            return _on_cpu(op, name, "its decomposition rejects these arguments", args, kwargs)
        finally:
            active.discard(name)
        if out is NotImplemented:
            return _on_cpu(op, name, "its decomposition does not cover these arguments", args, kwargs)
        counts[name] += 1
        return out

    return kernel


def _reaches_fallback(qualified: str) -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return not any(has(qualified, key) for key in
                   ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "PrivateUse1"))


def register() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    lowered = set(_C._lowered_ops())
    for op, fn in decomposition_table.items():
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        schema = op._schema
        qualified = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        base = schema.name.split("::")[1]
        base = base[:-1] if base.endswith("_") and not base.endswith("__") else base
        if base in lowered or schema.name in _SKIP or schema.is_mutable or not _reaches_fallback(qualified):
            continue
        _library.impl(op, _kernel(op, qualified, fn), "PrivateUse1")
