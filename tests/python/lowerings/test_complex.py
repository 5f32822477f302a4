"""Complex tensors (complex64 and complex128) against CPU PyTorch: creation,
copies, pointwise math, the lazy conjugate/negative bits, real/imag and
view_as_real/view_as_complex views (reads and writes), reductions, matrix
products, torch.fft, autograd, and the CPU fallback of ops with no complex
lowering. Run in each mode (TORCH_PJRT_MODE=fused / strict)."""
import warnings

import pytest
import torch

import torch_pjrt
from conftest import DEVICE, assert_matches_cpu, fused_pass_only

COMPLEX = [torch.complex64, torch.complex128]
# The op sweeps (unary, binary, fft) run complex128 in the fused pass only; the strict pass still runs
# complex128 through creation, copies, views, reductions, products and autograd below.
SWEEP = [torch.complex64, *fused_pass_only(torch.complex128)]


def tol(dtype):
    real = dtype.to_real() if dtype.is_complex else dtype
    return dict(atol=1e-4, rtol=1e-4) if real == torch.float32 else dict(atol=1e-9, rtol=1e-9)


def crandn(*shape, dtype=torch.complex64):
    return torch.randn(*shape, dtype=dtype)


def rrandn(*shape, dtype=torch.complex64):
    return torch.randn(*shape, dtype=dtype.to_real())


def fallbacks():
    return dict(torch_pjrt.metrics()["cpu_fallbacks"])


def assert_lowered(fn, *args, **kw):
    """Matches CPU and ran no op on the CPU."""
    before = fallbacks()
    out = assert_matches_cpu(fn, *args, **kw)
    torch_pjrt.sync()
    assert fallbacks() == before, f"CPU fallbacks: {fallbacks()} (before {before})"
    return out


# ---- creation and copies ----


@pytest.mark.parametrize("dtype", COMPLEX)
def test_round_trip_and_tensor(dtype):
    x = crandn(3, 5, dtype=dtype)
    d = x.to(DEVICE)
    assert d.dtype == dtype and d.device.type == DEVICE
    torch.testing.assert_close(d.cpu(), x, atol=0, rtol=0)
    t = torch.tensor([1 + 2j, -3.5 - 0.25j], dtype=dtype, device=DEVICE)
    torch.testing.assert_close(t.cpu(), torch.tensor([1 + 2j, -3.5 - 0.25j], dtype=dtype), atol=0, rtol=0)
    # a strided CPU source and a strided tpu destination
    y = torch.zeros(5, 3, dtype=dtype, device=DEVICE)
    y.t().copy_(x)
    torch.testing.assert_close(y.cpu(), x.t(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_factories(dtype):
    assert_lowered(lambda t: torch.zeros(2, 3, dtype=dtype, device=t.device) + t, crandn(2, 3, dtype=dtype))
    assert_lowered(lambda t: torch.ones(2, 3, dtype=dtype, device=t.device) * t, crandn(2, 3, dtype=dtype))
    assert_lowered(lambda t: torch.full((4,), 1.5 - 2j, dtype=dtype, device=t.device) + t, crandn(4, dtype=dtype))
    assert_lowered(lambda t: t.to(dtype), rrandn(3, 4, dtype=dtype))
    assert_lowered(torch.complex, rrandn(3, 4, dtype=dtype), rrandn(4, dtype=dtype))
    assert_lowered(torch.polar, rrandn(3, 4, dtype=dtype).abs(), rrandn(3, 4, dtype=dtype))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_randn(dtype):
    torch.manual_seed(0)
    z = torch.randn(20000, dtype=dtype, device=DEVICE)
    assert z.dtype == dtype
    parts = torch.view_as_real(z).cpu()
    # As the CPU: each part ~ N(0, 1/2), so E|z|^2 = 1.
    assert abs(parts.mean().item()) < 0.03
    assert abs(parts.std(0) - 0.5**0.5).max().item() < 0.03
    assert abs((z.abs() ** 2).mean().item() - 1) < 0.05


@pytest.mark.parametrize("dtype", COMPLEX)
def test_complex_to_real_cast_keeps_real_part(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Casting complex values to real discards the imaginary part"
        assert_lowered(lambda t: t.to(dtype.to_real()), crandn(6, dtype=dtype))


# ---- pointwise ----

UNARY = ["neg", "abs", "angle", "exp", "log", "sqrt", "sin", "cos", "tanh", "reciprocal", "conj_physical", "sgn"]


MORE_UNARY = ["exp2", "log2", "log10", "log1p", "expm1", "rsqrt", "sigmoid", "tan", "square", "sinh", "cosh", "asin",
              "acos", "atan", "asinh", "acosh", "atanh", "silu"]


def grid(dtype):
    """Real and imaginary parts over signs, zero, small and large values: branch cuts and overflow."""
    parts = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 1e-3, 20.0])
    return torch.complex(parts[:, None].expand(9, 9), parts[None, :].expand(9, 9)).reshape(-1).to(dtype)


@pytest.mark.parametrize("dtype", SWEEP)
@pytest.mark.parametrize("op", UNARY + MORE_UNARY)
def test_unary_over_the_plane(op, dtype):
    f = getattr(torch.nn.functional, op) if op == "silu" else getattr(torch, op)
    assert_lowered(f, crandn(4, 5, dtype=dtype) * 0.5, **tol(dtype))
    assert_lowered(f, grid(dtype), **tol(dtype))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_isnan(dtype):
    x = torch.tensor([1 + 1j, complex(float("nan"), 0), complex(0, float("nan")), 2j], dtype=dtype)
    assert_lowered(torch.isnan, x)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_data_movement(dtype):
    x = crandn(4, 5, dtype=dtype)
    idx = torch.tensor([3, 0, 2])
    assert_lowered(lambda t: t.flip(0), x)
    assert_lowered(lambda t: t.roll(2, 1), x)
    assert_lowered(lambda t: t.tril(), x)
    assert_lowered(lambda t: t.triu(1), x)
    assert_lowered(lambda t: torch.cat([t, t.conj()]), x)
    assert_lowered(lambda t: torch.stack([t, t * 1j], -1), x)
    assert_lowered(lambda t, m: t.masked_fill(m, 2 - 1j), x, x.real > 0)
    assert_lowered(lambda t, i: t.index_select(1, i), x, idx)
    assert_lowered(lambda t, i: t[i], x, idx)
    assert_lowered(lambda t, i: t.gather(1, i.expand(4, 3)), x, idx)

    def put(t, i):
        z = t.clone()
        z[i] = 5j
        z.index_put_((i,), t[:3] * 2, accumulate=True)
        return z

    assert_lowered(put, x, idx)
    assert_lowered(lambda t, i: t.scatter(0, i[:, None].expand(3, 5), t[:3] * 1j), x, idx)
    assert_lowered(lambda t, i: t.scatter_add(1, i[None].expand(4, 3), t[:, :3]), x, idx, **tol(dtype))


@pytest.mark.parametrize("dtype", SWEEP)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
def test_binary(op, dtype):
    f = getattr(torch, op)
    assert_lowered(f, crandn(4, 5, dtype=dtype), crandn(5, dtype=dtype), **tol(dtype))
    # with a real tensor and with Python scalars (real and complex)
    assert_lowered(f, crandn(4, 5, dtype=dtype), rrandn(4, 5, dtype=dtype), **tol(dtype))
    assert_lowered(lambda t: f(t, 2.5), crandn(4, 5, dtype=dtype), **tol(dtype))
    assert_lowered(lambda t: f(t, 1.5 - 0.5j), crandn(4, 5, dtype=dtype), **tol(dtype))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_in_place_and_alpha(dtype):
    assert_lowered(lambda a, b: a.clone().add_(b, alpha=2), crandn(3, 3, dtype=dtype), crandn(3, 3, dtype=dtype))
    assert_lowered(lambda a, b: a.clone().mul_(b).sub_(1j), crandn(3, 3, dtype=dtype), crandn(3, 3, dtype=dtype),
                   **tol(dtype))
    assert_lowered(lambda a, b: torch.where(a.real > 0, a, b), crandn(3, 3, dtype=dtype), crandn(3, 3, dtype=dtype))
    assert_lowered(lambda a: a == a.conj(), torch.tensor([1 + 0j, 1 + 1j, -2 + 0j], dtype=dtype))
    assert_lowered(lambda a, b, c: torch.addcmul(a, b, c, value=2), *(crandn(3, dtype=dtype) for _ in range(3)),
                   **tol(dtype))
    assert_lowered(lambda a, b, c: torch.addcdiv(a, b, c), *(crandn(3, dtype=dtype) for _ in range(3)), **tol(dtype))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_truthiness(dtype):
    # a complex value is true when either part is nonzero (not just the real part)
    x = torch.tensor([0j, 1j, 2 + 0j, -1 - 1j, complex(0, -0.0)], dtype=dtype)
    assert_lowered(lambda t: t.to(torch.bool), x)
    assert_lowered(lambda t: t.bool().int(), x)
    assert_lowered(torch.logical_not, x)
    assert_lowered(lambda t: torch.logical_and(t, t.flip(0)), x)
    assert_lowered(lambda t: torch.logical_xor(t, torch.tensor(1j, dtype=dtype)), x)
    assert_lowered(lambda t: (t.any(), t.all(), t[:3].all(), torch.count_nonzero(t)), x)


# ---- the conjugate and negative bits ----


@pytest.mark.parametrize("dtype", COMPLEX)
def test_conj_bit_reads(dtype):
    x = crandn(3, 4, dtype=dtype)
    assert_lowered(lambda t: t.conj(), x)
    assert_lowered(lambda t: t.conj() + 1, x)
    assert_lowered(lambda t: t.conj() * t, x, **tol(dtype))
    assert_lowered(lambda t: t.conj().resolve_conj(), x)
    assert_lowered(lambda t: t.conj().clone(), x)
    assert_lowered(lambda t: t.conj().imag, x)  # a negative-bit view
    assert_lowered(lambda t: t.conj().imag * 2, x)
    assert_lowered(lambda t: t.conj().t().contiguous(), x)
    assert_lowered(lambda t: torch.view_as_real(t.conj().resolve_conj()), x)
    d = x.to(DEVICE).conj()
    assert d.is_conj()
    torch.testing.assert_close(d.cpu(), x.conj(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_conj_bit_writes(dtype):
    x = crandn(2, 3, dtype=dtype)

    def copy_into_conj(t):
        z = torch.zeros_like(t)
        z.conj().copy_(t)
        return z

    def add_into_conj(t):
        z = t.clone()
        z.conj().add_(1 + 1j)
        return z

    def neg_imag_write(t):
        z = t.clone()
        z.conj().imag.copy_(torch.arange(3.0, dtype=dtype.to_real()))  # a view with the negative bit
        return z

    def copy_from_cpu_conj(t):
        z = torch.zeros_like(t)
        z.copy_(t.cpu().conj())
        return z

    for fn in (copy_into_conj, add_into_conj, neg_imag_write, copy_from_cpu_conj):
        assert_matches_cpu(fn, x)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_conj_in_matmul(dtype):
    a, b = crandn(3, 4, dtype=dtype), crandn(5, 4, dtype=dtype)
    assert_lowered(lambda p, q: p @ q.conj().T, a, b, **tol(dtype))  # mm sees the bit (a PyTorch fallthrough)
    assert_lowered(lambda p, q: p.conj() @ q.T, a, b, **tol(dtype))
    assert_lowered(lambda p, q: p @ q.mH, a, b, **tol(dtype))


# ---- views ----


@pytest.mark.parametrize("dtype", COMPLEX)
def test_real_imag_views(dtype):
    x = crandn(4, 6, dtype=dtype)
    assert_lowered(lambda t: t.real, x)
    assert_lowered(lambda t: t.imag, x)
    assert_lowered(lambda t: t[:, 1::2].real * 2, x)
    assert_lowered(lambda t: t.t().imag + t.t().real, x)

    def write_real(t):
        z = t.clone()
        z.real.add_(1)
        return z

    def write_imag_slice(t):
        z = t.clone()
        z[1:3, ::2].imag.mul_(-3)
        return z

    def write_through_transpose(t):
        z = t.clone()
        z.t()[2].real.fill_(7)
        return z

    for fn in (write_real, write_imag_slice, write_through_transpose):
        assert_lowered(fn, x)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_view_as_real_and_complex(dtype):
    x = crandn(4, 3, dtype=dtype)
    assert_lowered(torch.view_as_real, x)
    assert_lowered(lambda t: torch.view_as_real(t[1:]) * 2, x)
    assert_lowered(torch.view_as_complex, rrandn(5, 2, dtype=dtype))
    assert_lowered(lambda t: torch.view_as_complex(t[1:]) + 1j, rrandn(5, 3, 2, dtype=dtype))

    def write_through_view_as_real(t):
        z = t.clone()
        r = torch.view_as_real(z)
        r[:, :, 1].zero_()  # imaginary parts
        r[0].add_(5)
        return z

    def write_through_view_as_complex(t):
        z = t.clone()
        torch.view_as_complex(z).mul_(1j)
        return z

    assert_lowered(write_through_view_as_real, x)
    assert_lowered(write_through_view_as_complex, rrandn(4, 2, dtype=dtype))


# ---- reductions and products ----


@pytest.mark.parametrize("dtype", COMPLEX)
def test_reductions(dtype):
    x = crandn(4, 5, dtype=dtype)
    assert_lowered(torch.sum, x, **tol(dtype))
    assert_lowered(lambda t: t.sum(1), x, **tol(dtype))
    assert_lowered(lambda t: t.mean(0, keepdim=True), x, **tol(dtype))
    assert_lowered(lambda t: t.prod(1), x, **tol(dtype))
    assert_lowered(lambda t: t.conj().sum(0), x, **tol(dtype))
    assert_lowered(lambda t: t.cumsum(1), x, **tol(dtype))
    assert_lowered(lambda t: t.cumprod(0), x, **tol(dtype))


@pytest.mark.parametrize("dtype", COMPLEX)
def test_norms_and_isinf(dtype):
    x = crandn(3, 4, dtype=dtype)
    for ord in (2, 1, float("inf"), 0, 3):
        assert_lowered(lambda t: torch.linalg.vector_norm(t, ord=ord, dim=1), x, **tol(dtype))
    assert_lowered(lambda t: torch.linalg.vector_norm(t), x, **tol(dtype))
    big = 3e38 if dtype == torch.complex64 else 1.5e308
    y = torch.tensor([complex(float("inf"), 0), complex(0, float("-inf")), complex(float("nan"), float("inf")),
                      complex(big, big), 1 + 1j, complex(float("nan"), 0)], dtype=dtype)
    assert_lowered(torch.isinf, y)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_products(dtype):
    a, b = crandn(3, 4, dtype=dtype), crandn(4, 2, dtype=dtype)
    assert_lowered(torch.mm, a, b, **tol(dtype))
    assert_lowered(torch.matmul, a, b, **tol(dtype))
    assert_lowered(torch.bmm, crandn(2, 3, 4, dtype=dtype), crandn(2, 4, 5, dtype=dtype), **tol(dtype))
    assert_lowered(lambda p, q: torch.addmm(p, q, q.T, beta=0.5, alpha=2), crandn(3, 3, dtype=dtype), a, **tol(dtype))
    assert_lowered(torch.mv, a, crandn(4, dtype=dtype), **tol(dtype))
    assert_lowered(lambda p, q: p @ q, a, rrandn(4, 2, dtype=dtype).to(dtype), **tol(dtype))
    assert_lowered(torch.vdot, crandn(5, dtype=dtype), crandn(5, dtype=dtype), **tol(dtype))  # conjugates self
    assert_lowered(torch.vdot, rrandn(5, dtype=dtype), rrandn(5, dtype=dtype), **tol(dtype))


# ---- FFT ----

FFTS = [
    ("fft", lambda t: torch.fft.fft(t), "c"),
    ("fft_n_dim0_ortho", lambda t: torch.fft.fft(t, n=7, dim=0, norm="ortho"), "c"),
    ("fft_of_real", lambda t: torch.fft.fft(t), "r"),
    ("ifft", lambda t: torch.fft.ifft(t), "c"),
    ("ifft_forward", lambda t: torch.fft.ifft(t, norm="forward"), "c"),
    ("ifft_n", lambda t: torch.fft.ifft(t, n=3), "c"),
    ("rfft", lambda t: torch.fft.rfft(t), "r"),
    ("rfft_n_ortho", lambda t: torch.fft.rfft(t, n=9, norm="ortho"), "r"),
    ("irfft", lambda t: torch.fft.irfft(t), "c"),
    ("irfft_n_odd", lambda t: torch.fft.irfft(t, n=7), "c"),
    ("irfft_n_short", lambda t: torch.fft.irfft(t, n=4, norm="forward"), "c"),
    ("fftn", lambda t: torch.fft.fftn(t), "c"),
    ("fftn_s", lambda t: torch.fft.fftn(t, s=(3, 8)), "c"),
    ("ifftn", lambda t: torch.fft.ifftn(t, norm="ortho"), "c"),
    ("rfftn", lambda t: torch.fft.rfftn(t), "r"),
    ("irfftn", lambda t: torch.fft.irfftn(t), "c"),
    ("irfftn_s", lambda t: torch.fft.irfftn(t, s=(4, 9)), "c"),
    ("fft2", lambda t: torch.fft.fft2(t), "c"),
    ("fftn_3d", lambda t: torch.fft.fftn(t.reshape(2, 2, 2, 3)), "c"),
    ("fft_of_slice", lambda t: torch.fft.fft(t[:, 1:]), "c"),
    ("fft_of_conj", lambda t: torch.fft.fft(t.conj()), "c"),
]


@pytest.mark.parametrize("dtype", SWEEP)
@pytest.mark.parametrize("name,fn,kind", FFTS, ids=[f[0] for f in FFTS])
def test_fft(name, fn, kind, dtype):
    x = crandn(4, 6, dtype=dtype) if kind == "c" else rrandn(4, 6, dtype=dtype)
    t = dict(atol=1e-4, rtol=1e-4) if dtype == torch.complex64 else dict(atol=1e-9, rtol=1e-9)
    assert_lowered(fn, x, **t)


def test_fft_round_trip():
    x = rrandn(8, 16)
    assert_lowered(lambda t: torch.fft.irfft(torch.fft.rfft(t), n=16), x, atol=1e-5, rtol=1e-5)
    assert_lowered(lambda t: torch.fft.ifftn(torch.fft.fftn(t)), crandn(3, 4, 5), atol=1e-5, rtol=1e-5)


# ---- autograd ----


@pytest.mark.parametrize("dtype", COMPLEX)
def test_autograd(dtype):
    def grads(a, b):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        loss = (a * b).abs().sum() + torch.view_as_real(a * 2).pow(2).sum()
        loss.backward()
        return a.grad, b.grad

    assert_matches_cpu(grads, crandn(3, 4, dtype=dtype), crandn(3, 4, dtype=dtype), **tol(dtype))


# ---- ops without a complex lowering run on the CPU ----


@pytest.mark.parametrize(
    "op,fn",
    [
        # lowerings that do not declare complex support (they would take the real part, compare
        # complex values or test only the real part for inf) never see complex values
        ("aten::var.correction", lambda t: t.var(1)),
        ("aten::lerp.Scalar", lambda t: torch.lerp(t, t * 2, 0.3)),
        ("aten::logsumexp", lambda t: torch.logsumexp(t, 1)),
    ],
)
def test_ops_without_a_complex_lowering_fall_back_and_are_counted(op, fn):
    x = crandn(3, 4)
    x[0, 0] = complex(float("inf"), 1)
    before = fallbacks().get(op, 0)
    assert_matches_cpu(fn, x, atol=1e-5, rtol=1e-5)
    torch_pjrt.sync()
    assert fallbacks().get(op, 0) > before


def test_complex32_raises():
    with pytest.raises(RuntimeError, match="tpu tensors do not support dtype ComplexHalf"):
        torch.zeros(2, dtype=torch.complex32, device=DEVICE)


# ---- PyTorch's OpInfo samples in complex64: right results, lowered or on the CPU ----

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")
OPINFO_SKIP_PREFIX = ("sparse.", "to_sparse", "nn.functional.dropout", "linalg.eig")
OPINFO_SKIP = {
    "item", "to", "stft", "istft", "tensor_split", "as_strided", "as_strided_scatter", "chalf",  # complex32
    "svd_lowrank", "pca_lowrank",  # random projections: singular vectors match only up to a complex phase
    "bernoulli", "exponential", "normal", "uniform", "rand_like", "randn_like", "randint_like", "randint",
    "multinomial", "cauchy", "geometric", "log_normal", "randn", "rand", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "empty_permuted",
}
OPINFO_OPS = [op for op in common.op_db
              if torch.complex64 in op.supported_dtypes("cpu") and op.name not in OPINFO_SKIP
              and not op.name.startswith(OPINFO_SKIP_PREFIX)]


@pytest.mark.parametrize("op", OPINFO_OPS, ids=lambda op: op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""))
def test_opinfo_complex64(op):
    import torch.utils._pytree as pytree

    ran = 0
    for sample in list(op.sample_inputs("cpu", torch.complex64, requires_grad=False))[:3]:
        args = (sample.input, sample.args, sample.kwargs)
        try:
            expected = op(sample.input, *sample.args, **sample.kwargs)
        except Exception:
            continue  # the CPU rejects this sample too
        inp, a, kw = pytree.tree_map(lambda v: v.detach().to(DEVICE) if isinstance(v, torch.Tensor) else v, args)
        if "device" in kw:
            kw = dict(kw, device=DEVICE)
        actual = op(inp, *a, **kw)
        for e, x in zip(pytree.tree_leaves(expected), pytree.tree_leaves(actual)):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(x.cpu(), e, equal_nan=True, atol=1e-3, rtol=1e-3, check_stride=False)
        ran += 1
    if ran == 0:
        pytest.skip("no complex64 sample runs on CPU")


@pytest.mark.parametrize("parts", [(torch.float32, torch.float64), (torch.float64, torch.float32),
                                   (torch.float16, torch.float32)])
def test_complex_of_mixed_part_dtypes_raises_as_on_cpu(parts):
    # The meta kernel promotes; the CPU kernel insists on one dtype. The device must raise, not compute.
    real, imag = torch.ones(3, dtype=parts[0]), torch.ones(3, dtype=parts[1])
    with pytest.raises(RuntimeError) as cpu:
        torch.complex(real, imag)
    with pytest.raises(RuntimeError) as dev:
        torch.complex(real.to(DEVICE), imag.to(DEVICE))
    assert str(cpu.value).split("\n")[0] in str(dev.value)


def test_mixed_float_dtypes_still_promote():
    a, b = torch.randn(4, dtype=torch.float32), torch.randn(4, dtype=torch.float64)
    for op in (torch.add, torch.mul, torch.maximum, torch.atan2):
        got = op(a.to(DEVICE), b.to(DEVICE))
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.cpu(), op(a, b))
