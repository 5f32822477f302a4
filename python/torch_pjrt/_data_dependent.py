"""Device paths for ops whose result size depends on the data: nonzero,
masked_select, bincount and unique (boolean-mask indexing reaches nonzero
from C++).

Each computes the size on the device, reads only that (one small host read,
which also runs the pending fused graph), then builds the result of that size
with lowered ops on the device, instead of copying the inputs to the CPU and
back. Inputs the CPU kernel rejects go to it, so its error is raised.
"""
from __future__ import annotations

import torch

from . import _decompositions

aten = torch.ops.aten
_library = None


def _nonzero_flat(flat: torch.Tensor):
    """Positions (int64) of the True entries of a 1-d bool tensor, in order."""
    count = int(flat.sum().item())  # the one host read
    n = flat.numel()
    # Entry i goes to slot cumsum(flat)[i] - 1; False entries to a spare slot past the end.
    slot = torch.where(flat, torch.cumsum(flat, 0) - 1, count)
    out = torch.zeros(count + 1, dtype=torch.long, device=flat.device)
    out.scatter_(0, slot, torch.arange(n, device=flat.device))
    return out[:count]


def _nonzero(self):
    if self.is_complex() or self.numel() >= 2 ** 31 - 1:
        return _decompositions._on_cpu(aten.nonzero.default, "aten::nonzero", "complex or huge input", (self,), {})
    flat = self.reshape(-1) != 0
    idx = _nonzero_flat(flat) if self.numel() else torch.zeros(0, dtype=torch.long, device=self.device)
    if self.dim() == 0:
        return torch.zeros((idx.numel(), 0), dtype=torch.long, device=self.device)
    coords = []
    stride = 1
    for size in reversed(self.shape):
        coords.append(torch.remainder(torch.div(idx, stride, rounding_mode="floor"), size) if size else idx)
        stride *= size
    return torch.stack(coords[::-1], dim=1)


def _masked_select(self, mask):
    if mask.dtype != torch.bool or mask.device != self.device:
        return _decompositions._on_cpu(aten.masked_select.default, "aten::masked_select", "its checks", (self, mask), {})
    x, m = torch.broadcast_tensors(self, mask)
    if x.numel() == 0:
        return torch.empty(0, dtype=self.dtype, device=self.device)
    return x.reshape(-1)[_nonzero_flat(m.reshape(-1))]


def _bincount(self, weights=None, minlength=0):
    valid = (self.dim() == 1 and not self.is_floating_point() and not self.is_complex() and self.dtype != torch.bool
             and minlength >= 0 and (weights is None or (weights.shape == self.shape and weights.device == self.device)))
    if not valid:
        return _decompositions._on_cpu(aten.bincount.default, "aten::bincount", "its checks",
                                       (self, weights, minlength), {})
    # The CPU's result dtype: int64 counts, float32 weights sum in float32, other weights in float64.
    dtype = torch.long if weights is None else (torch.float if weights.dtype == torch.float else torch.double)
    if self.numel() == 0:
        return torch.zeros(minlength, dtype=dtype, device=self.device)
    index = self if self.dtype in (torch.int32, torch.long) else self.long()  # index_add_ takes int32/int64
    low, high = torch.stack([self.min(), self.max()]).to(torch.long).tolist()  # the one host read
    if low < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    counts = torch.zeros(max(high + 1, minlength), dtype=dtype, device=self.device)
    source = torch.ones_like(self, dtype=dtype) if weights is None else weights.to(dtype)
    return counts.index_add_(0, index, source)


def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    """torch.unique: sorts on the device, reads back the number of distinct
    values only. Always sorted (sorted=False leaves the order unspecified). NaNs
    are all distinct, as on the CPU."""
    if self.is_complex():
        return _decompositions._on_cpu(aten._unique2.default, "aten::_unique2", "complex input",
                                       (self, sorted, return_inverse, return_counts), {})
    device, long = self.device, torch.long
    empty = torch.empty(0, dtype=long, device=device)
    flat = self.reshape(-1)
    n = flat.numel()
    if n == 0:
        return (torch.empty(0, dtype=self.dtype, device=device),
                torch.zeros(self.shape, dtype=long, device=device) if return_inverse else empty, empty)
    values, order = torch.sort(flat, stable=True)
    first = torch.cat([torch.ones(1, dtype=torch.bool, device=device), values[1:] != values[:-1]])
    group = torch.cumsum(first, 0) - 1  # each sorted position's distinct value
    count = int(group[-1].item()) + 1  # the one host read
    # Each distinct value as its first occurrence, as the CPU (-0.0 or 0.0, whichever comes first).
    starts = torch.full((count,), n, dtype=long, device=device).scatter_reduce_(
        0, group, torch.arange(n, device=device), "amin")
    uniques = values[starts]
    inverse = (torch.empty(n, dtype=long, device=device).scatter_(0, order, group).reshape(self.shape)
               if return_inverse else empty)
    counts = (torch.zeros(count, dtype=long, device=device).index_add_(0, group, torch.ones(n, dtype=long, device=device))
              if return_counts else empty)
    return uniques, inverse, counts


_KERNELS = {"nonzero": _nonzero, "masked_select": _masked_select, "bincount": _bincount, "_unique2": _unique2}


def register() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for name, kernel in _KERNELS.items():
        _library.impl(name, kernel, "PrivateUse1")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": torch's own meta
        _library.impl("_grouped_mm", _grouped_mm_meta, "Meta", allow_override=True)  # torch <= 2.12: not the default


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's meta kernel for _grouped_mm states CUDA's rule (bfloat16 only);
    the CPU kernel and tpu's lowering take every floating dtype. Other dtypes
    get the same checks on bfloat16 stand-ins of the same shapes and strides."""
    from torch._meta_registrations import meta_grouped_mm
    dtype = mat_a.dtype
    if dtype == torch.bfloat16 or not dtype.is_floating_point or mat_b.dtype != dtype:
        return meta_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
    torch._check(out_dtype in (None, dtype), lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    stand_in = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta")
    return meta_grouped_mm(stand_in(mat_a), stand_in(mat_b), offs, bias).to(dtype)
