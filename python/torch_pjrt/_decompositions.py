"""PyTorch's own decompositions for ops that have no C++ lowering.

An op reaches the device's boxed fallback when PyTorch has no generic kernel
for it (only CPU/CUDA ones). Where torch._decomp has a decomposition into ops
we do lower, that runs on the device instead of a round trip to the CPU.
"""
from __future__ import annotations

import collections

import torch
from torch._decomp import decomposition_table

from . import _C

counts: collections.Counter = collections.Counter()
_library = None

# Decompositions that are slower or less exact than the CPU kernel they replace.
_SKIP = {"aten::nonzero", "aten::unique", "aten::masked_select"}


def _wrap(name, fn):
    def kernel(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

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
        _library.impl(op, _wrap(qualified, fn), "PrivateUse1")
