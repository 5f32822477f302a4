"""uint8 bilinear/bicubic resampling bit-identical to PyTorch's CPU kernel.

The CPU computes uint8 interpolation in fixed point (UpSampleKernel.cpp,
"Weights computation for uint8_t and multiplication trick"): per dimension,
double weights are scaled to int16 with a precision chosen from the largest
weight, each output is (2^(p-1) + sum(pixel * weight)) >> p clamped to
[0, 255], and the width pass (if the width changes) runs before the height
pass, rounding to uint8 in between. A float computation rounded once differs
by 1 on 10-20% of pixels, so the device reproduces that algorithm: the
weight tables are computed here on the host (they depend only on sizes and
options) and the passes are integer gathers, products and sums on the device.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch._prims_common import suggest_memory_format


def _scale(in_size: int, out_size: int, align_corners: bool, scale) -> float:
    # area_pixel_compute_scale<double>
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def _linear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _cubic(a: float):
    def f(x: float) -> float:
        x = abs(x)
        if x < 1.0:
            return ((a + 2) * x - (a + 3)) * x * x + 1
        if x < 2.0:
            return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
        return 0.0
    return f


def _taps_plain(i, in_size, scale, taps, fn, align_corners):
    """Window start, length and weights of output i without antialiasing."""
    cubic = taps > 2
    if align_corners:
        real = scale * i
    else:
        real = scale * (i + 0.5) - 0.5
        if not cubic and real < 0:
            real = 0.0
    index = min(int(math.floor(np.float32(real))), in_size - 1)  # the CPU floors in float
    lam = min(max(real - index, 0.0), 1.0)
    support = int(taps * 0.5)
    lo, hi = index - support + 1, index + support + 1
    start = max(lo, 0)
    length = min(max(min(hi, in_size) - start, 0), taps)
    w = [0.0] * taps
    w_max, at = 0.0, 0
    for j in range(taps):  # out-of-range taps add onto the border weight, as the CPU does
        w[j] = 0.0
        v = fn(float(j + 1 - support) - lam)
        if lo + j <= 0:
            at = 0
        elif lo + j >= in_size - 1:
            at = length - 1
        w[at] += v
        w_max = max(w_max, w[at])
        at += 1
    return start, length, w, w_max


def _taps_antialias(i, in_size, scale, support, taps, fn):
    center = scale * (i + 0.5)
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    start = max(int(center - support + 0.5), 0)
    length = min(max(min(int(center + support + 0.5), in_size) - start, 0), taps)
    w = [fn((j + start - center + 0.5) * inv) for j in range(length)]
    total = sum_in_order(w)
    w_max = 0.0
    if total != 0.0:
        w = [v / total for v in w]
        w_max = max(w, default=0.0)
    return start, length, w + [0.0] * (taps - length), w_max


def sum_in_order(values):
    total = 0.0
    for v in values:
        total += v
    return total


@functools.lru_cache(maxsize=256)
def _tables(in_size, out_size, align_corners, scale, cubic, antialias):
    """(indices [out, taps] int64, int16-valued weights [out, taps] int32, precision)."""
    s = _scale(in_size, out_size, align_corners, scale)
    interp = 4 if cubic else 2
    fn = _cubic(-0.5 if antialias else -0.75) if cubic else _linear
    if antialias:
        support = interp * 0.5 * s if s >= 1.0 else interp * 0.5
        taps = int(math.ceil(support)) * 2 + 1
        rows = [_taps_antialias(i, in_size, s, support, taps, fn) for i in range(out_size)]
    else:
        taps = interp
        rows = [_taps_plain(i, in_size, s, taps, fn, align_corners) for i in range(out_size)]
    w_max = max((r[3] for r in rows), default=0.0)
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    index = np.zeros((out_size, taps), np.int64)
    weight = np.zeros((out_size, taps), np.int32)
    for o, (start, length, w, _) in enumerate(rows):
        for j in range(length):
            v = w[j] * (1 << precision)
            index[o, j] = start + j
            weight[o, j] = np.int16(int(v - 0.5) if v < 0 else int(v + 0.5))
    return torch.from_numpy(index), torch.from_numpy(weight), precision


def _pass(x: torch.Tensor, dim: int, out_size: int, align_corners, scale, cubic, antialias) -> torch.Tensor:
    """One fixed-point pass along `dim` of an int32 image, rounded and clamped to uint8 values."""
    index, weight, precision = _tables(x.shape[dim], out_size, align_corners, scale, cubic, antialias)
    taps = index.shape[1]
    gathered = x.index_select(dim, index.reshape(-1).to(x.device)).unflatten(dim, (out_size, taps))
    shape = [out_size, taps] + [1] * (x.dim() - dim - 1)
    acc = (gathered * weight.reshape(shape).to(x.device)).sum(dim + 1)
    if precision > 0:
        acc = torch.bitwise_right_shift(acc + (1 << (precision - 1)), precision)
    return acc.clamp(0, 255)


def resample(x: torch.Tensor, output_size, align_corners: bool, scales_h, scales_w,
             cubic: bool, antialias: bool) -> torch.Tensor:
    out_h, out_w = output_size
    y = x.to(torch.int32)
    if out_w != x.shape[3]:  # width first, as the CPU
        y = _pass(y, 3, out_w, align_corners, scales_w, cubic, antialias)
    if out_h != x.shape[2]:
        y = _pass(y, 2, out_h, align_corners, scales_h, cubic, antialias)
    # The CPU's layout: the input's suggested memory format (ATen's rule, which reads strides: a sliced
    # channels_last input stays channels_last, a batch of one made by unsqueeze does not).
    return y.to(torch.uint8).contiguous(memory_format=suggest_memory_format(x))


# op name -> (cubic, antialias)
OPS = {"upsample_bilinear2d": (False, False), "upsample_bicubic2d": (True, False),
       "_upsample_bilinear2d_aa": (False, True), "_upsample_bicubic2d_aa": (True, True)}
