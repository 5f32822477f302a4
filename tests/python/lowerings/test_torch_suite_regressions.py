"""Regressions found by running PyTorch's own device-generic tests on `tpu`.

Each test compares with CPU PyTorch: the same values, or the same error type
and message, as the CPU kernel.
"""
import time
import warnings

import pytest
import torch
import torch_pjrt  # noqa: F401
from conftest import assert_same_error, errors_of

warnings.filterwarnings("ignore", message="torch_pjrt:")


# ---- errors: a meta kernel or decomposition that rejects sends the call to the CPU kernel ----

def test_add_float_alpha_with_integer_and_bool_tensors():
    for dtype in (torch.int32, torch.bool):
        x = torch.ones(4, dtype=dtype)
        assert_same_error(lambda a: torch.add(a, a, alpha=1.1), x)


def test_integer_addcdiv_raises_cpu_message():
    t = torch.tensor(1, dtype=torch.int16)
    assert_same_error(lambda a: torch.addcdiv(a, a, a), t)
    assert_same_error(lambda a: torch.addcdiv(a, a, a, out=a), t)
    assert_same_error(lambda a: a.clone().addcdiv_(a, a), t)


def test_clamp_without_bounds_raises_cpu_message():
    x = torch.randn(10)
    assert_same_error(lambda a: a.clamp(), x)
    assert_same_error(lambda a: a.clone().clamp_(), x)


def test_heaviside_mixed_dtypes_raises():
    x = torch.tensor([-1.0, 0.0, 2.0])
    v = torch.tensor([1], dtype=torch.int8)
    assert_same_error(torch.heaviside, x, v)


def test_heaviside_same_dtypes_matches_cpu():
    x = torch.tensor([-1.0, 0.0, 2.0, float("nan")])
    v = torch.tensor([0.5])
    torch.testing.assert_close(torch.heaviside(x.to("tpu"), v.to("tpu")).cpu(), torch.heaviside(x, v),
                               equal_nan=True)


def test_index_errors_match_cpu():
    a = torch.ones(2, 3)
    assert_same_error(lambda t: t[torch.tensor([True, False, True])], a)  # mask of the wrong length
    assert_same_error(lambda t: t[torch.tensor([], dtype=torch.float)], a)  # float indices


def test_adaptive_pool_backward_empty_output_message():
    x = torch.randn(1, 64, 10, 9)

    def run(t):
        t = t.detach().requires_grad_()
        out = torch.nn.functional.adaptive_avg_pool2d(t, (0, 0))
        out.sum().backward()
        return t.grad

    assert_same_error(run, x)


# ---- decompositions: a 0-d CPU tensor joins the device (as on CUDA) ----

def test_copysign_with_cpu_scalar_tensor():
    b = torch.tensor([[4.0, -8.0, -0.0], [0.0, -1.0, 3.0]])
    expected = torch.copysign(torch.tensor(1.0), b)
    got = torch.copysign(torch.tensor(1.0), b.to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected)
    assert torch.equal(torch.signbit(got.cpu()), torch.signbit(expected))


# ---- max pooling: one windowed reduction, compile time independent of the kernel volume ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
def test_max_pool3d_large_kernel_matches_cpu(dtype, channels_last):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, 8, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    results = []
    for device in ("cpu", "tpu"):
        t = x.detach().to(device).requires_grad_()
        out, ind = torch.nn.functional.max_pool3d(t, 7, 7, return_indices=True)
        out.backward(torch.arange(out.numel(), dtype=dtype).reshape(out.shape).to(device))
        results.append((out.detach().cpu(), ind.cpu(), t.grad.cpu()))
    (o_cpu, i_cpu, g_cpu), (o_tpu, i_tpu, g_tpu) = results
    torch.testing.assert_close(o_tpu, o_cpu)
    torch.testing.assert_close(i_tpu, i_cpu)
    torch.testing.assert_close(g_tpu, g_cpu)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(2, 3), stride=1),
                                    dict(kernel_size=3, stride=2, dilation=2, ceil_mode=True),
                                    dict(kernel_size=2, stride=2, ceil_mode=True)])
def test_max_pool2d_ties_nan_padding_and_overlap_match_cpu(kwargs):
    torch.manual_seed(0)
    x = torch.randint(-2, 3, (2, 3, 9, 10)).float()  # many ties
    x[0, 0, 1, 1] = float("nan")
    x[1, 2] = -float("inf")  # all -inf plane: indices must not point into the padding
    results = []
    for device in ("cpu", "tpu"):
        t = x.detach().to(device).requires_grad_()
        out, ind = torch.nn.functional.max_pool2d(t, return_indices=True, **kwargs)
        out.backward(torch.ones_like(out))
        results.append((out.detach().cpu(), ind.cpu(), t.grad.cpu()))
    (o_cpu, i_cpu, g_cpu), (o_tpu, i_tpu, g_tpu) = results
    torch.testing.assert_close(o_tpu, o_cpu, equal_nan=True)
    torch.testing.assert_close(i_tpu, i_cpu)
    torch.testing.assert_close(g_tpu, g_cpu)


def test_max_pool3d_fused_graph_compiles_quickly():
    # The unrolled lowering made a graph of ~11k ops that XLA compiled for minutes.
    x = torch.randn(4, 8, 8, 8, 8, device="tpu").requires_grad_()
    start = time.time()
    out, _ = torch.nn.functional.max_pool3d(x, 7, 7, return_indices=True)
    out.backward(torch.ones_like(out))
    x.grad.cpu()
    assert time.time() - start < 30


@pytest.mark.parametrize("dims,fmt", [((2, 3, 6, 6), torch.channels_last), ((2, 3, 6, 6, 6), torch.channels_last_3d)])
def test_max_pool_keeps_channels_last_as_cpu(dims, fmt):
    x = torch.randn(*dims).contiguous(memory_format=fmt)
    pool = torch.nn.functional.max_pool2d if len(dims) == 4 else torch.nn.functional.max_pool3d
    for device in ("cpu", "tpu"):
        t = x.detach().to(device).requires_grad_()
        out, ind = pool(t, 2, 2, return_indices=True)
        out.backward(torch.ones_like(out))
        got = (out.is_contiguous(memory_format=fmt), ind.is_contiguous(memory_format=fmt),
               t.grad.is_contiguous(memory_format=fmt))
        if device == "cpu":
            expected = got
    assert got == expected


# ---- index_put_ values that do not broadcast to the indexing result ----

def _setitem(a, index, value):
    a = a.clone()
    a[index] = value
    return a


@pytest.mark.parametrize("index, value_shape", [
    (lambda d: torch.tensor([0, 1], device=d), (3, 3)),  # 2 rows indexed, 3 given
    (lambda d: torch.tensor(True, device=d), (5, 1, 5, 3)),  # a prefix of non-1 sizes
    (lambda d: (torch.tensor([0, 1], device=d), slice(None)), (2, 2)),
])
def test_setitem_value_shape_mismatch_raises_cpu_error(index, value_shape):
    for device in ("cpu", "tpu"):
        a = torch.zeros(5, 3, device=device)
        with pytest.raises(RuntimeError, match="shape mismatch: value tensor of shape") as info:
            a[index(device)] = torch.ones(value_shape, device=device)
        assert "cannot be broadcast to indexing result of shape" in str(info.value)
        # The error is raised at the call and leaves the tensor (and its graph) usable.
        a[index(device)] = 2.0
        got = a.cpu()
        expected = torch.zeros(5, 3)
        expected[index("cpu")] = 2.0
        torch.testing.assert_close(got, expected)


def test_index_put_value_shape_mismatch_raises_cpu_message():
    a = torch.zeros(5, 3)
    idx = (torch.tensor([0, 1]),)
    assert_same_error(lambda t, v: t.clone().index_put_(idx, v), a, torch.ones(3, 3))
    assert_same_error(lambda t, v: t.clone().index_put_(idx, v, accumulate=True), a, torch.ones(3, 3))
    assert_same_error(lambda t, v: torch.index_put(t, idx, v), a, torch.ones(2, 2))


def test_index_put_broadcasting_value_matches_cpu():
    a = torch.randn(5, 3)
    idx = torch.tensor([4, 0])
    for v in (torch.randn(3), torch.randn(2, 1), torch.randn(1, 3), torch.randn(2, 3)):
        got = torch.index_put(a.to("tpu"), (idx.to("tpu"),), v.to("tpu")).cpu()
        torch.testing.assert_close(got, torch.index_put(a, (idx,), v))


# ---- CPU kernels without integer or bool versions raise as on the CPU ----

@pytest.mark.parametrize("dtype", [torch.int16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("name, fn", [
    ("adaptive_avg_pool2d", lambda x: torch.nn.functional.adaptive_avg_pool2d(x, (2, 2))),
    ("adaptive_avg_pool3d", lambda x: torch.nn.functional.adaptive_avg_pool3d(x[None], (2, 2, 2))),
    ("adaptive_max_pool2d", lambda x: torch.nn.functional.adaptive_max_pool2d(x, (2, 2))),
    ("avg_pool2d", lambda x: torch.nn.functional.avg_pool2d(x, 2)),
    ("softmax", lambda x: torch.softmax(x, 0)),
    ("gelu", torch.nn.functional.gelu),
    ("silu", torch.nn.functional.silu),
])
def test_integer_inputs_to_float_only_kernels_raise_cpu_error(dtype, name, fn):
    x = (torch.randn(4, 4, 4, 4) * 3).to(dtype)
    cpu, tpu = errors_of(fn, x)
    if cpu is None:  # this dtype has a CPU kernel: same values
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x))
        return
    # NotImplementedError is a RuntimeError; a Python decomposition's fallback
    # (adaptive_max_pool2d) re-raises it through the dispatcher as RuntimeError.
    assert isinstance(tpu, RuntimeError), f"tpu: {tpu!r}; CPU: {cpu!r}"
    assert str(cpu).split("\n")[0] in str(tpu), f"tpu: {tpu}\nCPU: {cpu}"


def test_integer_ops_with_kernels_still_run():
    x = torch.arange(-8, 8, dtype=torch.int32).reshape(4, 4)
    for fn in (lambda t: t + 1, lambda t: t.cumsum(0), lambda t: t.clamp(-2, 3), lambda t: torch.relu(t),
               lambda t: t.sum(1), lambda t: torch.nn.functional.max_pool2d(t[None].float(), 2)):
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x))


# ---- layer and batch norm statistics: the CPU kernels' dtypes and shapes ----

def _outputs_match_cpu(fn, *args, atol, rtol):
    expected = fn(*args)
    actual = fn(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    for e, a in zip(expected, actual):
        a = a.cpu()
        assert (a.dtype, a.shape) == (e.dtype, e.shape), f"tpu {a.dtype}{list(a.shape)}, CPU {e.dtype}{list(e.shape)}"
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


_LOW_TOL = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=0.1, rtol=0.1),
            torch.float32: dict(atol=1e-5, rtol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("param_dtype", ["none", "same", "float32"])
def test_native_layer_norm_statistics_match_cpu(dtype, param_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=dtype)
    w = None if param_dtype == "none" else torch.randn(4, dtype=dtype if param_dtype == "same" else torch.float32)
    _outputs_match_cpu(lambda x, w: torch.native_layer_norm(x, [4], w, w, 1e-5), x, w, **_LOW_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("param_dtype", ["none", "same", "float32"])
def test_native_batch_norm_statistics_match_cpu(dtype, training, param_dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=dtype)
    if param_dtype == "none" and not training:
        pytest.skip("eval mode without running stats crashes the CPU kernel")
    pdt = dtype if param_dtype in ("none", "same") else torch.float32
    rm, rv = torch.randn(3, dtype=pdt), torch.rand(3, dtype=pdt) + 0.5
    w = None if param_dtype == "none" else torch.randn(3, dtype=pdt)
    if param_dtype == "none":
        rm = rv = None
    _outputs_match_cpu(lambda x, w, rm, rv: torch.native_batch_norm(x, w, w, rm, rv, training, 0.1, 1e-5),
                       x, w, rm, rv, **_LOW_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_norm_gradients_match_cpu(dtype):
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 3, 5, dtype=dtype), torch.randn(5, dtype=dtype), torch.randn(4, 3, 5, dtype=dtype)
    norms = [lambda x, w: torch.nn.functional.layer_norm(x, [5], w, w),
             lambda x, w: torch.nn.functional.batch_norm(x, None, None, w[:3], w[:3], training=True)]
    for norm in norms:
        grads = []
        for device in ("cpu", "tpu"):
            xx, ww = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
            y = norm(xx, ww)
            y.backward(g.to(device))
            grads.append([xx.grad.cpu(), ww.grad.cpu()])
        for e, a in zip(*grads):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a.float(), e.float(), atol=0.05 * e.float().abs().max().item(), rtol=0.05)
