"""Each lowered op family against CPU PyTorch, over dtypes, broadcasting and scalars."""
import pytest
import torch
import torch.nn.functional as F

import torch_pjrt

from conftest import assert_matches_cpu, fused_pass_only

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# The unary sweep runs float16 and float64 in the fused pass only: float32 and bfloat16 (a half type whose
# every result is rounded and stored) take strict mode's own path for each op.
UNARY_FLOATS = [torch.float32, torch.bfloat16, *fused_pass_only(torch.float16, torch.float64)]
INTS = [torch.int32, torch.int64]


def rand(*shape, dtype=torch.float32, low=-3, high=3):
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(*shape) * (high - low) + low).to(dtype)
    return torch.randint(low, high + 1, shape, dtype=dtype)


UNARY = ["abs", "neg", "exp", "expm1", "sin", "cos", "tanh", "sigmoid", "ceil", "floor", "round", "sign", "atan",
         "erf", "reciprocal", "trunc", "frac", "relu", "square"]
POSITIVE = ["log", "log1p", "log2", "log10", "sqrt", "rsqrt", "lgamma"]


@pytest.mark.parametrize("dtype", UNARY_FLOATS)
@pytest.mark.parametrize("name", UNARY + POSITIVE)
def test_unary_float(name, dtype):
    x = rand(4, 5, dtype=dtype, low=0.1 if name in POSITIVE else -3)
    assert_matches_cpu(getattr(torch, name), x)


@pytest.mark.parametrize("dtype", INTS + [torch.int8])
@pytest.mark.parametrize("name", ["abs", "neg", "sign", "bitwise_not", "square"])
def test_unary_int(name, dtype):
    assert_matches_cpu(getattr(torch, name), rand(4, 5, dtype=dtype))


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "maximum", "minimum", "atan2", "fmod", "remainder",
                                  "pow", "eq", "ne", "lt", "le", "gt", "ge", "floor_divide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_binary_broadcast(name, dtype):
    if name in ("atan2",) and not dtype.is_floating_point:
        pytest.skip("float-only op")
    a = rand(3, 1, 4, dtype=dtype)
    b = rand(5, 1, dtype=dtype, low=1, high=4) if name in ("div", "fmod", "remainder", "floor_divide", "pow") else rand(5, 1, dtype=dtype)
    if name == "pow":
        a = a.abs() + (1 if dtype.is_floating_point else 0)
    assert_matches_cpu(getattr(torch, name), a, b)


def test_type_promotion_and_scalars():
    i = rand(4, dtype=torch.int32)
    f = rand(4)
    h = rand(4, dtype=torch.float16)
    assert_matches_cpu(lambda a, b: a + b, i, f)
    assert_matches_cpu(lambda a: a * 2.5, i)
    assert_matches_cpu(lambda a: a / 2, i)
    assert_matches_cpu(lambda a, b: a * b, h, f)
    assert_matches_cpu(lambda a: a + 1, h)
    assert_matches_cpu(lambda a, b: a + b, f, torch.tensor(3.0))  # 0-d tensor broadcasts
    assert_matches_cpu(lambda a: torch.add(a, a, alpha=2), f)
    assert_matches_cpu(lambda a: 2 - a, f)
    assert_matches_cpu(lambda a: a > 0.5, f)
    assert_matches_cpu(lambda b: b & True, rand(4, dtype=torch.bool))


def test_logical_where_clamp():
    a, b = rand(4, 5), rand(4, 5)
    m = rand(4, 5, dtype=torch.bool)
    assert_matches_cpu(torch.where, m, a, b)
    assert_matches_cpu(lambda m, a: torch.where(m, a, 0.0), m, a)
    assert_matches_cpu(torch.logical_and, m, a > 0)
    assert_matches_cpu(torch.logical_or, m, a > 0)
    assert_matches_cpu(torch.logical_xor, m, a > 0)
    assert_matches_cpu(torch.logical_not, m)
    assert_matches_cpu(lambda a: a.clamp(-1, 0.5), a)
    assert_matches_cpu(lambda a: a.clamp(min=0), a)
    assert_matches_cpu(lambda a, b: torch.clamp(a, max=b), a, b)
    assert_matches_cpu(lambda a, b: torch.lerp(a, b, 0.3), a, b)
    assert_matches_cpu(lambda a, b, c: torch.addcmul(a, b, c, value=0.5), a, b, rand(4, 5))
    assert_matches_cpu(lambda a, b, c: torch.addcdiv(a, b, c, value=2), a, b, rand(4, 5, low=1, high=2))
    assert_matches_cpu(lambda a, m: a.masked_fill(m, -1.5), a, m)
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    assert_matches_cpu(torch.isnan, x)
    assert_matches_cpu(torch.isinf, x)
    assert_matches_cpu(lambda x: torch.nan_to_num(x, nan=0.5), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16, torch.bool])
def test_casts(dtype):
    x = rand(3, 4, low=-5, high=5)
    for target in [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.bool, torch.uint8]:
        src = x.to(dtype)
        if target == torch.uint8:
            src = src.abs() if dtype != torch.bool else src
        assert_matches_cpu(lambda a: a.to(target), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_reductions(dtype):
    x = rand(4, 5, 6, dtype=dtype)
    assert_matches_cpu(lambda a: a.sum(), x)
    assert_matches_cpu(lambda a: a.sum(dim=(0, 2), keepdim=True), x)
    assert_matches_cpu(lambda a: a.amax(1), x)
    assert_matches_cpu(lambda a: a.amin((0, 1)), x)
    assert_matches_cpu(lambda a: a.argmax(2), x)
    assert_matches_cpu(lambda a: a.argmin(), x)
    assert_matches_cpu(lambda a: a.max(), x)
    assert_matches_cpu(lambda a: torch.max(a, 1), x)
    assert_matches_cpu(lambda a: torch.min(a, -1, keepdim=True), x)
    assert_matches_cpu(lambda a: (a > 0).any(1), x)
    assert_matches_cpu(lambda a: (a > -2).all(), x)
    assert_matches_cpu(lambda a: a.cumsum(1), x)
    if dtype.is_floating_point:
        assert_matches_cpu(lambda a: a.mean(1), x)
        assert_matches_cpu(lambda a: a.prod(0), x.clamp(-1.2, 1.2))
        assert_matches_cpu(lambda a: a.var(1), x)
        assert_matches_cpu(lambda a: a.std(dim=(0, 2), unbiased=False), x)
        assert_matches_cpu(lambda a: torch.var_mean(a, 2, correction=0), x)
        assert_matches_cpu(lambda a: a.logsumexp(1), x)
        assert_matches_cpu(lambda a: a.norm(), x)
        assert_matches_cpu(lambda a: torch.linalg.vector_norm(a, ord=1, dim=2), x)


def test_argmax_ties_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 1.0, float("nan"), 2.0]])
    assert_matches_cpu(lambda a: a.argmax(1), x)
    assert_matches_cpu(lambda a: a.max(1), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matmul_family(dtype):
    tol = {torch.bfloat16: dict(atol=0.1, rtol=0.05)}.get(dtype, {})
    a, b = rand(4, 6, dtype=dtype), rand(6, 3, dtype=dtype)
    assert_matches_cpu(torch.mm, a, b, **tol)
    assert_matches_cpu(torch.matmul, rand(2, 4, 6, dtype=dtype), rand(6, 3, dtype=dtype), **tol)
    assert_matches_cpu(torch.bmm, rand(2, 4, 6, dtype=dtype), rand(2, 6, 3, dtype=dtype), **tol)
    assert_matches_cpu(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), rand(3, dtype=dtype), a, b, **tol)
    assert_matches_cpu(lambda c, a, b: torch.baddbmm(c, a, b), rand(2, 4, 3, dtype=dtype), rand(2, 4, 6, dtype=dtype),
                       rand(2, 6, 3, dtype=dtype), **tol)
    assert_matches_cpu(torch.dot, rand(6, dtype=dtype), rand(6, dtype=dtype), **tol)
    assert_matches_cpu(torch.vdot, rand(6, dtype=dtype), rand(6, dtype=dtype), **tol)
    assert_matches_cpu(lambda c, a, b: torch.addbmm(c, a, b, beta=0.5, alpha=-1.5), rand(4, 3, dtype=dtype),
                       rand(2, 4, 6, dtype=dtype), rand(2, 6, 3, dtype=dtype), **tol)
    assert_matches_cpu(torch.mv, a, rand(6, dtype=dtype), **tol)
    assert_matches_cpu(F.linear, rand(5, 6, dtype=dtype), rand(3, 6, dtype=dtype), rand(3, dtype=dtype), **tol)
    assert_matches_cpu(lambda a, b: a @ b.t(), a, rand(3, 6, dtype=dtype), **tol)


def test_addmm_beta_zero_ignores_nan():
    c = torch.full((4, 3), float("nan"))
    assert_matches_cpu(lambda c, a, b: torch.addmm(c, a, b, beta=0), c, rand(4, 6), rand(6, 3))


def test_shape_ops():
    x = rand(3, 4, 5)
    assert_matches_cpu(lambda a, b: torch.cat([a, b], 1), x, rand(3, 2, 5))
    assert_matches_cpu(lambda a, b: torch.stack([a, b], 0), x, x * 2)
    assert_matches_cpu(lambda a: torch.split(a, 2, dim=1), x)
    assert_matches_cpu(lambda a: torch.chunk(a, 3, dim=2), x)
    assert_matches_cpu(lambda a: a.flip(0, 2), x)
    assert_matches_cpu(lambda a: a.roll(2, 1), x)
    assert_matches_cpu(lambda a: a.roll((1, -2), (0, 2)), x)
    assert_matches_cpu(lambda a: a.roll(3), x)
    assert_matches_cpu(lambda a: F.pad(a, (1, 2, 0, 1)), x)
    assert_matches_cpu(lambda a: a.permute(2, 0, 1).reshape(5, 12), x)
    assert_matches_cpu(lambda a: a.transpose(0, 1).contiguous(), x)
    assert_matches_cpu(lambda a: a.unsqueeze(1).expand(3, 2, 4, 5) * 1, x)
    assert_matches_cpu(lambda a: a[:, None, 1:3].squeeze(), x)
    assert_matches_cpu(lambda a: a.repeat(2, 1, 1), x)
    assert_matches_cpu(lambda a: a.tril(), rand(5, 5))
    assert_matches_cpu(lambda a: a.triu(1), rand(2, 5, 5))
    assert_matches_cpu(lambda a: torch.sort(a, dim=1), x)
    assert_matches_cpu(lambda a: torch.sort(a, descending=True), x)
    assert_matches_cpu(lambda a: torch.topk(a, 2, dim=2), x)


def test_indexing_ops():
    x = rand(5, 4, 3)
    idx = torch.tensor([4, 0, 2, 2])
    assert_matches_cpu(lambda a, i: a.index_select(0, i), x, idx)
    assert_matches_cpu(lambda a, i: a.index_select(1, i[1:3]), x, idx)
    g = torch.randint(0, 4, (5, 2, 3))
    assert_matches_cpu(lambda a, i: torch.gather(a, 1, i), x, g)
    s = torch.randint(0, 5, (2, 4, 3))
    assert_matches_cpu(lambda a, i, src: a.scatter_add(0, i, src), x, s, rand(2, 4, 3))
    u = torch.stack([torch.randperm(5)[:2] for _ in range(12)], 1).reshape(2, 4, 3)  # distinct per column
    assert_matches_cpu(lambda a, i, src: a.scatter(0, i, src), x, u, rand(2, 4, 3))
    assert_matches_cpu(lambda a, i: a.scatter(0, i, 7.0), x, u)
    assert_matches_cpu(lambda a, i: a[i], x, idx)
    assert_matches_cpu(lambda a, i: a[:, i[1:]], x, idx)
    assert_matches_cpu(lambda a, i, j: a[i, :, j], x, idx, torch.tensor([0, 1, 2, -1]))
    assert_matches_cpu(lambda a, i, j: a[:, i, j], x, torch.tensor([[0], [3]]), torch.tensor([1, 2]))
    assert_matches_cpu(lambda a: a[a > 0], x)  # data-dependent: CPU fallback, still exact


def test_index_put():
    x = rand(5, 4)
    def put(a, i, v):
        a = a.clone()
        a[i] = v
        return a
    assert_matches_cpu(put, x, torch.tensor([0, 3]), rand(2, 4))
    assert_matches_cpu(put, x, torch.tensor([1, 2]), torch.tensor(9.0))
    def put2(a, i, j, v):
        a = a.clone()
        a[i, j] = v
        return a
    assert_matches_cpu(put2, x, torch.tensor([0, 3, 4]), torch.tensor([1, 0, -1]), rand(3))
    def acc(a, i, v):
        return a.index_put((i,), v, accumulate=True)
    assert_matches_cpu(acc, x, torch.tensor([0, 0, 2]), rand(3, 4))


def test_factories():
    torch_pjrt.reset_metrics()
    dev = "tpu"
    torch.testing.assert_close(torch.zeros(2, 3, device=dev).cpu(), torch.zeros(2, 3))
    torch.testing.assert_close(torch.ones(4, dtype=torch.int32, device=dev).cpu(), torch.ones(4, dtype=torch.int32))
    torch.testing.assert_close(torch.full((2, 2), 3.5, device=dev).cpu(), torch.full((2, 2), 3.5))
    torch.testing.assert_close(torch.arange(10, device=dev).cpu(), torch.arange(10))
    torch.testing.assert_close(torch.arange(1, 4, 0.5, device=dev).cpu(), torch.arange(1, 4, 0.5))
    torch.testing.assert_close(torch.linspace(0, 1, 7, device=dev).cpu(), torch.linspace(0, 1, 7))
    torch.testing.assert_close(torch.eye(3, 4, device=dev).cpu(), torch.eye(3, 4))
    torch.testing.assert_close(torch.zeros_like(torch.empty(3, device=dev)).cpu(), torch.zeros(3))
    torch.testing.assert_close(torch.tensor([1, 2, 3], device=dev).cpu(), torch.tensor([1, 2, 3]))
    torch.testing.assert_close(torch.arange(-3, 10, 3, dtype=torch.int32, device=dev).cpu(),
                               torch.arange(-3, 10, 3, dtype=torch.int32))
    assert not torch_pjrt.metrics()["cpu_fallbacks"], "factories are lowered, not run on the CPU"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nn_functional(dtype):
    tol = {torch.bfloat16: dict(atol=0.05, rtol=0.05)}.get(dtype, {})
    x = rand(2, 3, 8, 8, dtype=dtype)
    w = rand(4, 3, 3, 3, dtype=dtype, low=-0.3, high=0.3)
    assert_matches_cpu(lambda x, w: F.conv2d(x, w, padding=1, stride=2), x, w, **tol)
    assert_matches_cpu(lambda x: F.max_pool2d(x, 2), x, **tol)
    assert_matches_cpu(lambda x: F.avg_pool2d(x, 3, 2, 1), x, **tol)
    assert_matches_cpu(lambda x: F.adaptive_avg_pool2d(x, 2), x, **tol)
    assert_matches_cpu(lambda x: F.softmax(x, 1), x, **tol)
    assert_matches_cpu(lambda x: F.log_softmax(x, -1), x, **tol)
    assert_matches_cpu(lambda x: F.layer_norm(x, (8,)), x, **tol)
    assert_matches_cpu(lambda x: F.group_norm(x, 3), x, **tol)
    assert_matches_cpu(lambda x: F.batch_norm(x, None, None, training=True), x, **tol)
    assert_matches_cpu(lambda x: F.gelu(x), x, **tol)
    assert_matches_cpu(lambda x: F.gelu(x, approximate="tanh"), x, **tol)
    assert_matches_cpu(lambda x: F.silu(x), x, **tol)
    assert_matches_cpu(lambda x: F.leaky_relu(x, 0.1), x, **tol)
    assert_matches_cpu(lambda x: F.hardtanh(x), x, **tol)
    assert_matches_cpu(lambda x: F.softplus(x), x, **tol)
    assert_matches_cpu(lambda x: F.elu(x), x, **tol)
    emb = rand(10, 4, dtype=dtype)
    assert_matches_cpu(lambda e, i: F.embedding(i, e), emb, torch.tensor([[1, 9], [0, 1]]), **tol)


def test_losses():
    x, t = rand(6, 5), torch.randint(0, 5, (6,))
    assert_matches_cpu(F.cross_entropy, x, t)
    assert_matches_cpu(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), x, t)
    assert_matches_cpu(lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, reduction="sum"), x, t)
    assert_matches_cpu(lambda x, t: F.cross_entropy(x, t), rand(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3)))
    y = rand(6, 5)
    assert_matches_cpu(F.mse_loss, x, y)
    assert_matches_cpu(F.l1_loss, x, y)
    assert_matches_cpu(F.smooth_l1_loss, x, y)
    assert_matches_cpu(F.binary_cross_entropy_with_logits, x, torch.rand(6, 5))
    assert_matches_cpu(F.binary_cross_entropy, torch.rand(6, 5) * 0.9 + 0.05, torch.rand(6, 5))


@pytest.mark.parametrize("in_size,out_size", [((7, 9), (3, 4)), ((10, 10), (3, 3)), ((5, 6), (5, 6)), ((4, 5, 7), (2, 3, 3))])
def test_adaptive_avg_pool_uneven_windows_with_gradient(in_size, out_size):
    # Windows overlap or differ in size when the output does not divide the input.
    pool = F.adaptive_avg_pool3d if len(out_size) == 3 else F.adaptive_avg_pool2d
    x = torch.randn(2, 3, *in_size, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    torch_pjrt.reset_metrics()
    y, yt = pool(x, out_size), pool(xt, out_size)
    g = torch.randn_like(y)
    y.backward(g)
    yt.backward(g.to("tpu"))
    torch.testing.assert_close(yt.cpu(), y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-6)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


def test_hypot_signbit_erfc_edge_values():
    a = torch.tensor([0., -0., 1e30, -3., float("nan"), -float("nan"), float("inf"), 2., 1e-30, 0.])
    b = torch.tensor([0., 5., 1e30, 4., 1., 2., 3., -float("inf"), 1e-30, -2.])
    torch_pjrt.reset_metrics()
    assert_matches_cpu(torch.hypot, a, b)  # no overflow at 1e30, no underflow at 1e-30
    assert_matches_cpu(torch.signbit, a)   # -0.0 and -nan have the sign bit set
    assert_matches_cpu(torch.erfc, a)
    for dtype in [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8, torch.bool]:
        assert_matches_cpu(torch.signbit, torch.tensor([-2, 0, 3, -1]).to(dtype))
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_scatter_reduce(reduce, include_self, dtype):
    if reduce == "mean" and dtype == torch.int32:
        pytest.skip("integer mean floors on the CPU; it runs there")
    torch.manual_seed(0)
    x = rand(4, 5, dtype=dtype)
    src = rand(6, 5, dtype=dtype, low=-2, high=2)
    index = torch.randint(0, 3, (6, 5))  # duplicates, and row 3 is never reached
    torch_pjrt.reset_metrics()
    assert_matches_cpu(lambda x, s, i: x.scatter_reduce(0, i, s, reduce, include_self=include_self), x, src, index)
    assert_matches_cpu(lambda x, s, i: x.clone().scatter_reduce_(1, i, s, reduce, include_self=include_self),
                       x, src[:4], index[:4].clamp(max=4))
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_with_reduce_argument(reduce):
    x, src = rand(3, 4), rand(5, 4, low=-2, high=2)
    index = torch.randint(0, 3, (5, 4))
    torch_pjrt.reset_metrics()
    assert_matches_cpu(lambda x, s, i: x.scatter(0, i, s, reduce=reduce), x, src, index)
    assert_matches_cpu(lambda x, i: x.scatter(0, i, 1.5, reduce=reduce), x, index)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


def test_equal_returns_a_bool_without_fallback():
    a = torch.tensor([1.0, 2.0, float("nan")])
    cases = [(a[:2], a[:2]), (a[:2], torch.tensor([1.0, 3.0])), (a[:2], a[:1]), (a, a),
             (torch.tensor([1, 2]), torch.tensor([1.0, 2.0])), (torch.empty(0), torch.empty(0))]
    torch_pjrt.reset_metrics()
    for x, y in cases:
        got = torch.equal(x.to("tpu"), y.to("tpu"))
        assert isinstance(got, bool) and got == torch.equal(x, y), (x, y)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]
    with pytest.raises(RuntimeError, match="same device"):
        torch.equal(a.to("tpu"), a)


@pytest.mark.parametrize("op", ["median", "nanmedian", "kthvalue"])
def test_order_statistics(op):
    nan = float("nan")
    xs = [torch.randn(4, 7), torch.randint(0, 4, (3, 6)).float(), torch.randint(-5, 5, (5, 4)),
          torch.tensor([[1., nan, 3., 2.], [nan, nan, 1., 0.], [nan] * 4, [5., -1., 2., 2.]])]
    torch_pjrt.reset_metrics()
    for x in xs:
        xt = x.to("tpu")
        if op != "kthvalue":  # the whole-tensor form returns the value only
            torch.testing.assert_close(getattr(xt, op)().cpu(), getattr(x, op)(), equal_nan=True)
        for dim in range(x.dim()):
            for keepdim in (False, True):
                args = (2, dim, keepdim) if op == "kthvalue" else (dim, keepdim)
                want, got = getattr(x, op)(*args), getattr(xt, op)(*args)
                values, indices = got[0].cpu(), got[1].cpu()
                torch.testing.assert_close(values, want.values, equal_nan=True)
                assert indices.shape == want.indices.shape
                # Which of several equal elements is reported is up to the kernel
                # (the CPU's is not the first either); it must hold the value.
                picked = x.gather(dim, indices if keepdim else indices.unsqueeze(dim))
                torch.testing.assert_close(picked if keepdim else picked.squeeze(dim), values, equal_nan=True)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]


def test_zeta_and_polygamma_zero():
    torch.manual_seed(0)
    x, q = torch.rand(500) * 20 - 10, torch.rand(500) * 20 - 10
    torch_pjrt.reset_metrics()
    assert_matches_cpu(torch.special.zeta, x, q, rtol=1e-4, atol=1e-4)
    assert_matches_cpu(lambda x: torch.polygamma(0, x), q, rtol=1e-4, atol=1e-4)
    assert not torch_pjrt.metrics()["cpu_fallbacks"]
    # n >= 1 runs on the CPU (the plugin's polygamma is inaccurate at x < 0) and still matches.
    assert_matches_cpu(lambda x: torch.polygamma(2, x), q, rtol=1e-4, atol=1e-4)
    assert torch_pjrt.metrics()["cpu_fallbacks"]


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    torch.manual_seed(0)
    x, source = rand(5, 3), rand(4, 3, low=-2, high=2)
    index = torch.tensor([0, 2, 0, 4])  # a repeat, and rows 1 and 3 untouched
    torch_pjrt.reset_metrics()
    assert_matches_cpu(lambda x, s, i: x.index_reduce(0, i, s, reduce, include_self=include_self), x, source, index)
    assert_matches_cpu(lambda x, s, i: x.clone().index_reduce_(1, i, s, reduce, include_self=include_self),
                       x, rand(5, 2), torch.tensor([2, 2]))
    assert not torch_pjrt.metrics()["cpu_fallbacks"]
