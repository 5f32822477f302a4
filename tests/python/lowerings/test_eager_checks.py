"""Checks PyTorch makes on the CPU hold on tpu: memory overlap of written
tensors, out=/in-place dtype rules, dtype rules of index_put, unsupported
dtypes, and cached plans that follow global state (the default dtype).

Every case runs on CPU and on tpu: both raise the same error, or both give the
same values."""
import pytest
import torch

import torch_pjrt

DEVICE = "tpu"


def outcome(fn, device):
    """('ok', values) or ('error', message) of fn run on `device`."""
    try:
        result = fn(device)
    except (RuntimeError, IndexError, TypeError) as e:
        return "error", str(e).split("\n")[0]
    results = result if isinstance(result, (tuple, list)) else [result]
    return "ok", [r.detach().cpu() if isinstance(r, torch.Tensor) else r for r in results]


def assert_same_outcome(fn):
    expected = outcome(fn, "cpu")
    actual = outcome(fn, DEVICE)
    assert actual[0] == expected[0], f"cpu: {expected}, tpu: {actual}"
    if expected[0] == "error":
        assert actual[1] == expected[1]
        return
    for e, a in zip(expected[1], actual[1]):
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e, equal_nan=True)
        else:
            assert a == e


def arange(d, n=6, dtype=torch.float32):
    return torch.arange(n, dtype=dtype, device=d)


def idx(d, *values):
    return torch.tensor(values, device=d)


def expanded(d):
    return torch.ones(4, device=d).expand(3, 4)


# Writes into a tensor that overlaps itself, or an input, in ways CPU rejects
# or allows: the tpu must decide the same way.
OVERLAP_CASES = {
    # internal overlap of the written tensor
    "expand_add_": lambda d: expanded(d).add_(1),
    "expand_mul_": lambda d: expanded(d).mul_(2),
    "expand_copy_": lambda d: expanded(d).copy_(torch.zeros(3, 4, device=d)),
    "expand_clamp_": lambda d: expanded(d).clamp_(0, 1),
    "expand_relu_": lambda d: expanded(d).relu_(),
    "expand_uniform_": lambda d: expanded(d).uniform_(),
    "expand_index_add_": lambda d: expanded(d).index_add_(0, idx(d, 0), torch.ones(1, 4, device=d)),
    "expand_scatter_": lambda d: expanded(d).scatter_(0, torch.zeros(1, 4, dtype=torch.long, device=d),
                                                      torch.ones(1, 4, device=d)),
    "expand_add_out": lambda d: torch.add(torch.ones(3, 4, device=d), 1, out=expanded(d)),
    "expand_neg_out": lambda d: torch.neg(torch.ones(3, 4, device=d), out=expanded(d)),
    "expand_mm_out": lambda d: torch.mm(torch.ones(3, 4, device=d), torch.ones(4, 4, device=d), out=expanded(d)),
    "expand_cat_out": lambda d: torch.cat([torch.ones(2, 4, device=d), torch.ones(1, 4, device=d)], out=expanded(d)),
    # CPU allows these on an expanded tensor
    "expand_fill_": lambda d: expanded(d).fill_(3),
    "expand_zero_": lambda d: expanded(d).zero_(),
    "expand_masked_fill_": lambda d: expanded(d).masked_fill_(torch.ones(3, 4, dtype=torch.bool, device=d), 2),
    # partial overlap between the written tensor and an input
    "copy_shifted": lambda d: (lambda x: (x[1:].copy_(x[:-1]), x))(arange(d))[1],
    "mul_transposed": lambda d: (lambda x: x.mul_(x.t()))(arange(d, 4).view(2, 2)),
    "add_0d_inside": lambda d: (lambda x: x[1:].add_(x[1]))(arange(d)),
    "add_out_shifted": lambda d: (lambda x: torch.add(x[:-1], 1, out=x[1:]))(arange(d)),
    "neg_out_transposed": lambda d: (lambda x: torch.neg(x.view(2, 3).t(), out=x.view(3, 2)))(arange(d)),
    "clamp_tensor_shifted": lambda d: (lambda x: x[1:4].clamp_(x[:3]))(arange(d)),
    "cat_out_shifted": lambda d: (lambda x: torch.cat([x[:2], x[2:3]], out=x[1:4]))(arange(d)),
    "index_select_out_shifted": lambda d: (lambda x: torch.index_select(x[:3], 0, idx(d, 0, 1, 2), out=x[1:4]))(arange(d)),
    "gather_out_shifted": lambda d: (lambda x: torch.gather(x[:3], 0, idx(d, 0, 1, 2), out=x[1:4]))(arange(d)),
    "index_copy_shifted": lambda d: (lambda x: x[1:4].index_copy_(0, idx(d, 0, 1), x[:2]))(arange(d)),
    "index_add_shifted": lambda d: (lambda x: x[1:4].index_add_(0, idx(d, 0, 1), x[:2]))(arange(d)),
    "scatter_add_shifted": lambda d: (lambda x: x[1:4].scatter_add_(0, idx(d, 0, 1), x[:2]))(arange(d)),
    # the index family rejects full aliasing too
    "index_add_self": lambda d: (lambda x: x.index_add_(0, idx(d, 0, 1, 2, 3, 4, 5), x))(arange(d)),
    "index_put_self": lambda d: (lambda x: x.index_put_((idx(d, 0),), x[:1]))(arange(d)),
    # full aliasing and disjoint views: CPU allows
    "add_self": lambda d: (lambda x: x.add_(x))(arange(d)),
    "addcmul_self": lambda d: (lambda x: x.addcmul_(x, x))(arange(d)),
    "copy_self": lambda d: (lambda x: x.copy_(x))(arange(d)),
    "div_out_self": lambda d: (lambda x: torch.div(x, 2, out=x))(arange(d)),
    "where_out_self": lambda d: (lambda x: torch.where(x > 2, x, torch.zeros(6, device=d), out=x))(arange(d)),
    "mm_out_self": lambda d: (lambda x: torch.mm(x, x, out=x))(arange(d, 4).view(2, 2)),
    "copy_disjoint": lambda d: (lambda x: (x[3:].copy_(x[:3]), x))(arange(d))[1],
    "add_expanded_input": lambda d: (lambda x: x[:3].add_(x[3:4].expand(3)))(arange(d)),
    "index_fill_0d_value": lambda d: (lambda x: x[1:4].index_fill_(0, idx(d, 0, 1), x[0]))(arange(d)),
}


# Full aliasing that ATen lets through to BLAS: the CPU's values depend on its BLAS kernel (one machine's
# MKL zero-fills the output before reading the aliased inputs, another's reads them first), so only the
# outcome (no error, the shape and dtype) is PyTorch's behaviour; the device computes from the inputs.
BLAS_ALIASING = {"mm_out_self"}


@pytest.mark.parametrize("name", list(OVERLAP_CASES))
def test_memory_overlap_matches_cpu(name):
    if name not in BLAS_ALIASING:
        return assert_same_outcome(OVERLAP_CASES[name])
    expected, actual = outcome(OVERLAP_CASES[name], "cpu"), outcome(OVERLAP_CASES[name], DEVICE)
    assert expected[0] == actual[0] == "ok"
    assert [(t.shape, t.dtype) for t in actual[1]] == [(t.shape, t.dtype) for t in expected[1]]
    x = torch.arange(4.0).view(2, 2)
    torch.testing.assert_close(actual[1][0], x @ x)


DTYPE_CASES = {
    "neg_int_out_float": lambda d: torch.neg(idx(d, 1, 2, 3), out=torch.empty(3, device=d)),
    "abs_int_out_float": lambda d: torch.abs(idx(d, -1, 2), out=torch.empty(2, device=d)),
    "add_float_out_int": lambda d: torch.add(arange(d, 2), arange(d, 2), out=torch.empty(2, dtype=torch.long, device=d)),
    "add_f16_out_f64_overflows": lambda d: torch.add(
        torch.tensor([60000.0, 1.0, -40000.0], dtype=torch.float16, device=d),
        torch.tensor([60000.0, 1.0, -40000.0], dtype=torch.float16, device=d),
        out=torch.empty(3, dtype=torch.float64, device=d)),
    "mul_f16_out_f32_rounds": lambda d: torch.mul(
        torch.tensor([1.001, 3.3], dtype=torch.float16, device=d),
        torch.tensor([1.001, 7.7], dtype=torch.float16, device=d),
        out=torch.empty(2, dtype=torch.float32, device=d)),
    "add_int_out_float": lambda d: torch.add(idx(d, 1, 2), idx(d, 3, 4), out=torch.empty(2, device=d)),
    "div_int_out_long": lambda d: torch.div(idx(d, 1, 2), idx(d, 3, 4), out=torch.empty(2, dtype=torch.long, device=d)),
    "sin_int_out_double": lambda d: torch.sin(idx(d, 1, 2), out=torch.empty(2, dtype=torch.float64, device=d)),
    "eq_out_float": lambda d: torch.eq(arange(d, 3), 1, out=torch.empty(3, device=d)),
    "mm_out_double": lambda d: torch.mm(torch.ones(2, 2, device=d), torch.ones(2, 2, device=d),
                                        out=torch.empty(2, 2, dtype=torch.float64, device=d)),
    "int_add_float_inplace": lambda d: idx(d, 1, 2).add_(arange(d, 2)),
    "half_add_float_inplace": lambda d: torch.tensor([1.0, 2049.0], dtype=torch.float16, device=d).add_(
        torch.tensor([0.4, 1.0], device=d)),
    "int_div_inplace": lambda d: idx(d, 1, 2).div_(2),
    "index_put_double_into_float": lambda d: torch.zeros(4, device=d).index_put_(
        (idx(d, 0, 1),), torch.tensor([1.0, 2.0], dtype=torch.float64, device=d)),
    "index_put_long_into_float": lambda d: torch.zeros(4, device=d).index_put_((idx(d, 0, 1),), idx(d, 1, 2)),
    "index_put_same_dtype": lambda d: torch.zeros(4, device=d).index_put_((idx(d, 0, 1),), arange(d, 2)),
    "index_put_functional_dtype": lambda d: torch.zeros(4, device=d).index_put(
        (idx(d, 0, 1),), torch.tensor([1.0, 2.0], dtype=torch.float64, device=d)),
}


@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_written_dtype_rules_match_cpu(name):
    assert_same_outcome(DTYPE_CASES[name])


def test_setitem_with_other_dtype_raises_as_cpu():
    def setitem(d):
        x = torch.zeros(4, device=d)
        x[idx(d, 0, 1)] = torch.tensor([1.0, 2.0], dtype=torch.float64, device=d)
        return x

    assert_same_outcome(setitem)


@pytest.fixture
def default_dtype_restored():
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)


DEFAULT_DTYPE_CASES = {
    "int_true_divide": lambda d: idx(d, 1, 2, 7) / idx(d, 3, 4, 3),
    "int_times_python_float": lambda d: idx(d, 1, 2) * 1.5,
    "full_without_dtype": lambda d: torch.full((3,), 1.0 / 3, device=d),
    "arange_float": lambda d: torch.arange(0.0, 1.0, 0.25, device=d),
    "sum_then_true_divide": lambda d: idx(d, 1, 2, 3).sum() / 7,
}


@pytest.mark.modes_inside  # picks its modes: once per `make test`
@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("name", list(DEFAULT_DTYPE_CASES))
def test_cached_plans_follow_default_dtype(name, mode, default_dtype_restored):
    fn = DEFAULT_DTYPE_CASES[name]
    with torch_pjrt.mode(mode):
        for dtype in (torch.float32, torch.float64, torch.float32):  # each after a cached plan of the other
            torch.set_default_dtype(dtype)
            expected, actual = fn("cpu"), fn(DEVICE)
            assert actual.dtype == expected.dtype == dtype
            torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


# complex64/complex128 are supported (test_complex.py); complex32 and float8
# have no XLA type on the CPU plugin.
UNSUPPORTED_DTYPE_CASES = {
    "zeros": lambda: torch.zeros(2, dtype=torch.complex32, device=DEVICE),
    "empty": lambda: torch.empty(2, dtype=torch.complex32, device=DEVICE),
    "empty_strided": lambda: torch.empty_strided((2,), (1,), dtype=torch.complex32, device=DEVICE),
    "empty_like": lambda: torch.empty_like(torch.ones(2, device=DEVICE), dtype=torch.complex32),
    "new_empty": lambda: torch.ones(2, device=DEVICE).new_empty(3, dtype=torch.complex32),
    "to_tpu": lambda: torch.tensor([1 + 2j, 3 - 1j]).to(torch.complex32).to(DEVICE),
    "to_complex32": lambda: torch.ones(2, device=DEVICE).to(torch.complex32),
    "view_as_complex32": lambda: torch.view_as_complex(torch.ones(2, 2, dtype=torch.half, device=DEVICE)),
    "float8": lambda: torch.zeros(2, dtype=torch.float8_e4m3fn, device=DEVICE),
    "float8_to_tpu": lambda: torch.zeros(2).to(torch.float8_e5m2).to(DEVICE),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED_DTYPE_CASES))
def test_unsupported_dtypes_raise_instead_of_holding_zeros(name):
    with pytest.raises(RuntimeError, match=r"tpu tensors do not support dtype (ComplexHalf|Float8)"):
        UNSUPPORTED_DTYPE_CASES[name]()


def test_quantized_tensor_to_tpu_raises():
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        q.to(DEVICE)


def test_a_shape_error_is_the_users_error_not_a_cpu_fallback():
    import warnings

    before = dict(torch_pjrt.metrics()["cpu_fallbacks"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (lambda d: torch.randn(3, 4, device=d) @ torch.randn(5, 6, device=d),
                   lambda d: torch.mm(torch.randn(2, 3, device=d), torch.randn(2, 3, device=d))):
            assert_same_outcome(fn)
    assert torch_pjrt.metrics()["cpu_fallbacks"] == before
    assert not [w for w in caught if "runs on the CPU" in str(w.message)]
