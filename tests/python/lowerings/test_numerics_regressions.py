"""Silent wrong answers found by outside tests, each compared with CPU PyTorch."""
import pytest
import torch
import torch.nn.functional as F
import torch_pjrt  # noqa: F401
from conftest import assert_matches_cpu, to_dev


# ---- margin losses: torch._decomp's decompositions are wrong; ours follow the CPU kernels ----

MULTILABEL_CASES = [
    ((3, 4), [[3, 0, -1, 1], [0, 1, 2, 3], [-1, 2, 0, 1]]),  # labels after the first -1 are ignored
    ((4,), [3, 0, -1, 1]),  # 1-d: reduction='none' gives a 0-d result
    ((2, 5), [[1, 1, 4, -1, 0], [2, 0, 3, 1, 4]]),  # a repeated label
    ((0, 3), None),  # an empty batch: mean is 0
    ((), 0),
]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shape,target", MULTILABEL_CASES)
def test_multilabel_margin_loss_matches_cpu(shape, target, reduction):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    t = torch.zeros(shape, dtype=torch.long) if target is None else torch.tensor(target)
    out = assert_matches_cpu(lambda x, t: F.multilabel_margin_loss(x, t, reduction=reduction), x, t)
    assert out.shape == F.multilabel_margin_loss(x, t, reduction=reduction).shape


def test_multilabel_margin_loss_backward_matches_cpu():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    t = torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [-1, 2, 0, 1]])
    xc, xd = x.clone().requires_grad_(), to_dev(x).requires_grad_()
    F.multilabel_margin_loss(xc, t).backward()
    F.multilabel_margin_loss(xd, to_dev(t)).backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("target", [torch.tensor(2), torch.tensor([2])])
def test_multi_margin_loss_1d_shape_follows_target(target, reduction):
    torch.manual_seed(0)
    x = torch.randn(4)
    out = assert_matches_cpu(lambda x, t: F.multi_margin_loss(x, t, reduction=reduction), x, target)
    assert out.shape == F.multi_margin_loss(x, target, reduction=reduction).shape


# ---- sorting: -0.0 equals 0.0 (stable sorts keep input order), every NaN sorts largest ----

SIGNED = [0.0, -0.0, 0.0, -0.0, 1.0, -0.0, float("nan"), -float("nan"), -1.0, -0.0]


def _same_bits(actual, expected):
    assert actual.device.type == "tpu"
    actual = actual.cpu()
    assert torch.equal(actual.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(actual[keep], expected[keep]) and torch.equal(actual[keep].signbit(), expected[keep].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("descending", [False, True])
def test_stable_sort_of_signed_zeros_keeps_input_order(dtype, descending):
    v = torch.tensor(SIGNED, dtype=dtype)
    expected = torch.sort(v, stable=True, descending=descending)
    actual = torch.sort(v.to("tpu"), stable=True, descending=descending)
    assert actual.indices.cpu().tolist() == expected.indices.tolist()
    _same_bits(actual.values, expected.values)
    assert torch.argsort(v.to("tpu"), stable=True, descending=descending).cpu().tolist() == expected.indices.tolist()


def test_msort_and_2d_sort_of_signed_zeros():
    v = torch.tensor(SIGNED).reshape(5, 2)
    _same_bits(torch.msort(v.to("tpu")), torch.msort(v))
    expected = torch.sort(v.t(), dim=1, stable=True)
    actual = torch.sort(v.t().to("tpu"), dim=1, stable=True)
    assert torch.equal(actual.indices.cpu(), expected.indices)


def test_order_statistics_keep_the_sign_of_zero():
    # Tie order among equal values is the kernel's choice (CPU quickselect), so only
    # the values are compared: a -0.0 result is -0.0.
    v = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -0.0, -1.0])
    d = v.to("tpu")
    for k in range(1, 8):
        value = torch.kthvalue(d, k).values
        assert value.cpu() == torch.kthvalue(v, k).values and d[torch.kthvalue(d, k).indices].cpu().signbit() == \
            value.cpu().signbit()
    neg = torch.tensor([-0.0, -0.0, 1.0])
    _same_bits(torch.kthvalue(neg.to("tpu"), 1).values.reshape(1), torch.kthvalue(neg, 1).values.reshape(1))
    _same_bits(torch.median(neg.to("tpu")).reshape(1), torch.median(neg).reshape(1))
    assert torch.equal(torch.topk(v.to("tpu"), 3).values.cpu(), torch.topk(v, 3).values)


@pytest.mark.parametrize("values", [[0.0, -0.0, 0.0, -0.0, 1.0, -0.0], [-0.0, 0.0, 2.0, 1.0], [0.0, -0.0, -0.0]])
def test_unique_keeps_the_first_of_equal_zeros(values):
    v = torch.tensor(values)
    expected = torch.unique(v, return_inverse=True, return_counts=True)
    actual = torch.unique(v.to("tpu"), return_inverse=True, return_counts=True)
    _same_bits(actual[0], expected[0])
    assert torch.equal(actual[1].cpu(), expected[1]) and torch.equal(actual[2].cpu(), expected[2])


# ---- deterministic mode fills uninitialized memory (NaN, or the integer max) ----

@pytest.fixture
def deterministic_fill():
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


EMPTY_MAKERS = {
    "empty": lambda d, dt: torch.empty(2, 3, dtype=dt, device=d),
    "empty_strided": lambda d, dt: torch.empty_strided((2, 3), (1, 2), dtype=dt, device=d),
    "new_empty": lambda d, dt: torch.zeros(1, dtype=dt, device=d).new_empty((4,)),
    "empty_like": lambda d, dt: torch.empty_like(torch.zeros(3, dtype=dt, device=d)),
    "resize_grow": lambda d, dt: torch.zeros(2, dtype=dt, device=d).resize_(2, 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.complex64, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("make", list(EMPTY_MAKERS))
def test_deterministic_fill_uninitialized_memory(deterministic_fill, make, dtype):
    expected = EMPTY_MAKERS[make]("cpu", dtype)
    actual = EMPTY_MAKERS[make]("tpu", dtype)
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, equal_nan=True, rtol=0, atol=0)


def test_no_fill_without_fill_uninitialized_memory(deterministic_fill):
    torch.utils.deterministic.fill_uninitialized_memory = False
    assert not torch.empty(4, device="tpu").isnan().any()  # tpu's fresh memory reads zeros


# ---- out= of the 1-d factories into views: filled in the view's own shape when the count matches ----

FACTORIES_OUT = {
    "arange": lambda o: torch.arange(o.numel(), out=o),
    "arange_float": lambda o: torch.arange(0.5, o.numel() / 2, 0.5, out=o),
    "range": lambda o: torch.range(0, o.numel() - 1, out=o),
    "linspace": lambda o: torch.linspace(-1, 1, o.numel(), out=o),
    "logspace": lambda o: torch.logspace(0, 1, o.numel(), out=o),
    "arange_resized": lambda o: torch.arange(5, out=o),  # another count: resized to 1-d, as the CPU
    "full": lambda o: torch.full(o.shape, 3.0, out=o),
    "eye": lambda o: torch.eye(*o.shape, out=o),
    "zeros": lambda o: torch.zeros(o.shape, out=o),
}
OUT_VIEWS = {
    "rows_step": lambda od: od[::2],
    "transposed": lambda od: od.t(),
    "column": lambda od: od[:, 1],
    "flat_step": lambda od: od.view(-1)[::3],
}


@pytest.mark.parametrize("view", list(OUT_VIEWS))
@pytest.mark.parametrize("factory", list(FACTORIES_OUT))
def test_factory_out_into_view_matches_cpu(factory, view):
    results = []
    for device in ("cpu", "tpu"):
        base = torch.zeros(6, 4, device=device)
        out = OUT_VIEWS[view](base)
        r = FACTORIES_OUT[factory](out)
        results.append((base.cpu(), r.shape, r.stride(), out.shape, out.stride()))
    (cpu_base, *cpu_meta), (tpu_base, *tpu_meta) = results
    torch.testing.assert_close(tpu_base, cpu_base)
    assert tpu_meta == cpu_meta


# ---- memory overlap: kernels that reject an out= that is one of their inputs ----

OVERLAP_CASES = {
    "index_select": lambda a: torch.index_select(a, 0, torch.tensor([1, 0, 2], device=a.device), out=a),
    "index_select_index": lambda a: (lambda i: torch.index_select(a.long().flatten(), 0, i, out=i))(
        torch.tensor([1, 0, 2], device=a.device)),
    "gather": lambda a: torch.gather(a, 0, torch.zeros(3, 3, dtype=torch.long, device=a.device), out=a),
    "take_along_dim": lambda a: torch.take_along_dim(a, torch.zeros(3, 3, dtype=torch.long, device=a.device), 0,
                                                     out=a),
    "cat_one": lambda a: torch.cat([a], out=a),
    "cat_rows": lambda a: torch.cat([a[:1], a[1:]], out=a),
}


@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_out_aliasing_an_input_raises_as_cpu(case):
    from conftest import assert_same_error
    assert_same_error(OVERLAP_CASES[case], torch.arange(9.0).reshape(3, 3))


def test_gather_out_may_be_its_index():
    # gather only rejects partial overlap with its index: the index as the output is the CPU's choice to allow.
    make = lambda d: torch.tensor([[0, 1], [1, 0]], device=d)
    expected = (lambda i: torch.gather(torch.tensor([[5, 6], [7, 8]]), 1, i, out=i))(make("cpu"))
    actual = (lambda i: torch.gather(torch.tensor([[5, 6], [7, 8]], device="tpu"), 1, i, out=i))(make("tpu"))
    assert torch.equal(actual.cpu(), expected)


# CPU-fallback ops: PyTorch's fallback copied each argument on its own, hiding the aliasing from the CPU kernel.
FALLBACK_OVERLAP_CASES = {
    "take": lambda a: torch.take(a, torch.tensor([1, 0, 2], device=a.device), out=a[0]),
    "take_full": lambda a: torch.take(a, torch.arange(9, device=a.device).reshape(3, 3), out=a),
    "put_": lambda a: a.flatten().put_(torch.tensor([1, 0, 2], device=a.device), a.flatten()[:3]),
    "masked_select": lambda a: torch.masked_select(a.flatten(), torch.ones(9, dtype=torch.bool, device=a.device),
                                                   out=a.flatten()),
    "linalg_cross": lambda a: torch.linalg.cross(a, a[[1, 0, 2]], out=a),
}


@pytest.mark.parametrize("case", list(FALLBACK_OVERLAP_CASES))
def test_cpu_fallback_out_aliasing_an_input_raises_as_cpu(case):
    from conftest import assert_same_error
    assert_same_error(FALLBACK_OVERLAP_CASES[case], torch.arange(9.0).reshape(3, 3))


FALLBACK_SHARED_STORAGE = {
    # Written and read tensors in one storage without overlapping: the CPU computes; so must tpu.
    "take_disjoint": lambda a: torch.take(a[1:], torch.tensor([5, 0, 2], device=a.device), out=a[0]),
    "masked_scatter_disjoint": lambda a: a.flatten()[:4].masked_scatter_(
        torch.tensor([True, False, True, True], device=a.device), a.flatten()[4:]),
    "put_disjoint": lambda a: a.flatten()[:4].put_(torch.tensor([3, 0], device=a.device), a.flatten()[6:8],
                                                   accumulate=True),
}


@pytest.mark.parametrize("case", list(FALLBACK_SHARED_STORAGE))
def test_cpu_fallback_with_shared_storage_matches_cpu(case):
    results = []
    for device in ("cpu", "tpu"):
        a = torch.arange(9.0, device=device).reshape(3, 3)
        r = FALLBACK_SHARED_STORAGE[case](a)
        results.append((a.cpu(), r.cpu(), r.shape, r.stride()))
    (ca, cr, *cm), (ta, tr, *tm) = results
    assert torch.equal(ta, ca) and torch.equal(tr, cr) and tm == cm
