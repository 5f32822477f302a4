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
from torch._prims_common.wrappers import out_wrapper

from . import _C, _resample_uint8

counts: collections.Counter = collections.Counter()  # op -> decomposed calls
_library = None
_active = threading.local()


def _as_schema_types(op, args):
    """Python kernels receive wrapped numbers (the `1` in `1 << t`) as Python
    numbers; calling the overload again needs tensors where its schema says Tensor."""
    arguments = op._schema.arguments
    return tuple(torch.tensor(a) if i < len(arguments) and isinstance(arguments[i].type, torch._C.TensorType)
                 and isinstance(a, (bool, int, float)) else a for i, a in enumerate(args))


def _on_cpu(op, name: str, why: str, args, kwargs):
    _C._note_cpu_fallback(name, why)
    args = _as_schema_types(op, args)
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


# Meta kernels for the fused RNN cells the device lowers (the executor asks
# the meta kernel for output shapes): PyTorch has none for the GRU cell, and
# its LSTM one fails on a cell without biases. Shapes as the CUDA kernels.
def _rnn_cell_check(input_gates, hidden_gates, input_bias, hidden_bias, factor, prev_hidden):
    name = "_thnn_fused_lstm_cell" if factor == 4 else "_thnn_fused_gru_cell"
    torch._check(input_gates.ndim == 2 and input_gates.shape == hidden_gates.shape,
                 lambda: f"{name}: gates {list(input_gates.shape)} and {list(hidden_gates.shape)} differ or are not 2-D")
    torch._check(prev_hidden.ndim == 2 and prev_hidden.numel() == input_gates.numel() // factor,
                 lambda: f"{name}: state {list(prev_hidden.shape)} does not fit gates {list(input_gates.shape)}")
    if input_bias is not None or hidden_bias is not None:
        torch._check(input_bias is not None and hidden_bias is not None and input_bias.ndim == 1
                     and input_bias.shape == hidden_bias.shape and input_bias.numel() == input_gates.shape[1],
                     lambda: f"{name}: biases do not fit gates {list(input_gates.shape)}")


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    _rnn_cell_check(input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    return cx.new_empty(cx.shape), cx.new_empty(cx.shape), input_gates.new_empty(input_gates.shape)


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    _rnn_cell_check(input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    return hx.new_empty(hx.shape), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    hidden = workspace.shape[-1] // 5
    gates = workspace.new_empty((workspace.shape[0], 3 * hidden))
    bias = workspace.new_empty((3 * hidden,)) if has_bias else None
    return gates, gates.new_empty(gates.shape), workspace.new_empty((workspace.shape[0], hidden)), bias, \
        None if bias is None else bias.new_empty(bias.shape)


def _bicubic_weights(in_size, out_size, align_corners, scale):
    """[in, out]: bicubic upsampling along one dim is x @ W (borders clamped).
    Built by the CPU kernel from an identity; a dim of size 1 is left as it is."""
    eye = torch.eye(in_size, dtype=torch.float64).reshape(in_size, 1, in_size, 1)
    w = torch.ops.aten.upsample_bicubic2d(eye, [out_size, 1], align_corners, scale, None)
    return w.reshape(in_size, out_size)


def _upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    # Bicubic upsampling is separable and linear: y = Wh^T x Ww per plane, so
    # the input gradient is Wh gy Ww^T (two matmuls on the device).
    wh = _bicubic_weights(input_size[2], output_size[0], align_corners, scales_h)
    ww = _bicubic_weights(input_size[3], output_size[1], align_corners, scales_w)
    compute = torch.float32 if grad_output.dtype in (torch.float16, torch.bfloat16) else grad_output.dtype
    wh, ww = (w.to(device=grad_output.device, dtype=compute) for w in (wh, ww))
    g = torch.matmul(torch.matmul(wh, grad_output.to(compute)), ww.t())
    return g.to(grad_output.dtype)


def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # PyTorch has no decomposition for it (wav2vec2/HuBERT's positional conv,
    # nn.utils.weight_norm). w = g * v / |v|, norms over every dim but `dim`:
    # grad_g = sum(grad_w * v) / |v|, grad_v = g / |v| * (grad_w - v * grad_g / |v|),
    # as ATen's _weight_norm_differentiable_backward; half types in float32 as the CPU kernel.
    for name, t in (("saved_v", saved_v), ("saved_g", saved_g), ("saved_norm", saved_norms)):
        torch._check(t.is_contiguous(), lambda: f"{name} must be contiguous")
    torch._check(dim == 0 or dim == saved_v.dim() - 1, lambda: "Expected dim to be the first or last dimension")
    compute = torch.float32 if saved_v.dtype in (torch.float16, torch.bfloat16) else saved_v.dtype
    v, g, norms, gw = (t.to(compute) for t in (saved_v, saved_g, saved_norms, grad_w))
    reduce = [d for d in range(v.dim()) if d != dim]
    sums = (gw * v).sum(reduce, keepdim=True) if reduce else gw * v
    norms, g = norms.reshape(sums.shape), g.reshape(sums.shape)
    grad_g = sums / norms
    grad_v = (g / norms) * (gw - v * (grad_g / norms))
    return grad_v.to(saved_v.dtype), grad_g.reshape(saved_g.shape).to(saved_g.dtype)


def _resample_kernel(op, name: str, cubic: bool, antialias: bool):
    """uint8 inputs: the CPU's fixed-point algorithm (_resample_uint8); other
    dtypes: PyTorch's decomposition where it has one, else the CPU."""
    decomposition = decomposition_table.get(op)
    other = _kernel(op, name, decomposition) if decomposition is not None else (
        lambda *args, **kwargs: _on_cpu(op, name, "no lowering for this dtype", args, kwargs))

    def kernel(input, output_size, align_corners, scales_h=None, scales_w=None):
        args = (input, output_size, align_corners, scales_h, scales_w)
        if input.dtype != torch.uint8:
            return other(*args)
        if _cpu_rejects(op, args, {}):
            return _on_cpu(op, name, "the CPU kernel rejects these arguments", args, {})
        counts[name] += 1
        return _resample_uint8.resample(input, output_size, align_corners, scales_h, scales_w, cubic, antialias)

    return kernel


@out_wrapper("output", "is_target")
def _multilabel_margin_loss_forward(input, target, reduction):
    # torch._decomp's version keeps the margins of labels after the first -1
    # (gathered from column 0) and returns shape (1,) for a 1-d input with
    # reduction='none'. As the CPU kernel: per sample, sum over its labels k
    # (those before the first -1) and non-label columns j of
    # max(0, 1 - x[k] + x[j]) / dim.
    # (Shape errors: the CPU kernel's, from _kernel's probe.)
    x, t = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = x.shape[1]
    idx = torch.arange(dim, device=t.device)
    end = torch.amin(torch.where(t == -1, idx, dim), dim=-1, keepdim=True)
    is_label = idx < end  # [n, k]: t[n, k] is one of the sample's labels
    labels = torch.where(is_label, t, 0)
    is_target = torch.any((idx == torch.where(is_label, t, -1).unsqueeze(-1)) & is_label.unsqueeze(-1), dim=1)
    u = torch.gather(x, -1, labels)  # [n, k]
    z = (1.0 - u.unsqueeze(-1) + x.unsqueeze(-2)).clamp_min(0) / dim  # [n, k, j]
    z = torch.where(is_label.unsqueeze(-1) & ~is_target.unsqueeze(-2), z, 0)
    z = z.sum(dim=(-2, -1))
    if reduction == 1:  # mean (0 for an empty batch, as the CPU kernel)
        z = z.sum() / max(z.shape[0], 1)
    elif reduction == 2:  # sum
        z = z.sum()
    elif input.dim() <= 1:
        z = z.reshape(())
    return z, is_target.to(input.dtype).reshape(target.shape)


@out_wrapper()
def _multi_margin_loss(input, target, p=1, margin=1, weight=None, reduction=1):
    # torch._decomp's returns shape (1,) for a 1-d input with reduction='none'; the CPU's follows the
    # target: () for a 0-d one.
    z = decomposition_table[torch.ops.aten.multi_margin_loss.default](input, target, p, margin, weight, reduction)
    return z.reshape(()) if reduction == 0 and target.dim() == 0 else z


# Decompositions used instead of torch._decomp's (which compute wrong values or shapes).
_OWN_DECOMPOSITIONS = {"multilabel_margin_loss_forward": _multilabel_margin_loss_forward,
                       "multi_margin_loss": _multi_margin_loss}

_PRIVATEUSE1 = {"upsample_bicubic2d_backward": _upsample_bicubic2d_backward,
                "_weight_norm_interface_backward": _weight_norm_interface_backward}

_META = {"_thnn_fused_lstm_cell": _lstm_cell_meta, "_thnn_fused_gru_cell": _gru_cell_meta,
         "_thnn_fused_gru_cell_backward": _gru_cell_backward_meta}


def register() -> None:
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for name, meta in _META.items():
        # Replaces torch's own Python meta for the LSTM cell: allow_override is
        # the default from torch 2.13 on, torch <= 2.12 refuses without it.
        _library.impl(name, meta, "Meta", allow_override=True)
    for name, kernel in _PRIVATEUSE1.items():
        _library.impl(name, kernel, "PrivateUse1")
    for name, (cubic, antialias) in _resample_uint8.OPS.items():
        op = getattr(torch.ops.aten, name).default
        _library.impl(op, _resample_kernel(op, f"aten::{name}", cubic, antialias), "PrivateUse1")
    for op, fn in decomposition_table.items():
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        schema = op._schema
        qualified = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        base = _C._op_base_name(schema.name)
        # The op's rule (lowering.h): lowered ops, and ops with a device kernel of their own
        # (skip_decomposition: data-dependent shapes, _data_dependent.py), keep no decomposition.
        rule = _C._op_traits(qualified) or {}
        if (rule.get("lowering") or rule.get("skip_decomposition") or schema.is_mutable or not _reaches_fallback(qualified)
                or (base in _resample_uint8.OPS and not schema.overload_name)):
            continue
        fn = _OWN_DECOMPOSITIONS.get(base, fn)
        _library.impl(op, _kernel(op, qualified, fn), "PrivateUse1")
