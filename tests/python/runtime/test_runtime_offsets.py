"""Nonzero storage offsets are runtime operands: a loop over slices of one tensor reuses one program.

The op signature (and the fused graph key) records only whether a tensor's
storage offset is zero; a nonzero offset reaches the program as an s64 operand,
as Python Scalars do. Every test compares against the same code on the CPU.
"""
import pytest
import torch

import torch_pjrt
from conftest import DEVICE

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

MODES = ["strict", "fused", "lazy", "debug"]


@pytest.fixture(params=MODES)
def mode(request):
    with torch_pjrt.mode(request.param):
        yield request.param


def check(fn, *tensors, **tol):
    """fn(*tensors) on CPU copies and on tpu copies: results and every (mutated) input agree."""
    cpu = [t.clone() for t in tensors]
    dev = [t.to(DEVICE) for t in tensors]
    expected = fn(*cpu)
    actual = fn(*dev)
    for e, a in zip(cpu + [expected], dev + [actual]):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a.cpu(), e, **tol)


def rows_read(x):
    return torch.stack([x[i] * 2 + 1 for i in range(x.shape[0])])


def columns_read(x):
    return torch.stack([x[:, i].sin() for i in range(x.shape[1])])


def diagonals_read(x):
    return torch.cat([x.diagonal(k) + 0 for k in range(-x.shape[0] + 1, x.shape[1])])


def rows_add_(x):
    for i in range(x.shape[0]):
        x[i].add_(i)
    return x


def columns_assign(x, v):
    for i in range(x.shape[1]):
        x[:, i] = v * i
    return x


def rows_copy_(x, y):
    for i in range(x.shape[0]):
        y[i].copy_(x[i] * 3)
    return y


def diagonals_mul_(x):
    for k in range(1, x.shape[1]):
        x.diagonal(k).mul_(k)
    return x


def transposed_rows(x):
    t = x.t()
    out = [t[i] + t[i, 1:] .sum() for i in range(1, t.shape[0])]
    for i in range(1, t.shape[0]):
        t[i, 1:].sub_(1)
    return torch.stack(out)


def channels_last_slices(x):
    out = []
    for i in range(x.shape[0]):
        out.append(x[i].exp())  # a permuted dense block at a nonzero offset
        x[i].mul_(2)
    return torch.stack(out)


def views_of_views(x):
    out = []
    for i in range(1, 4):
        v = x[i:][1][2:]  # a view of a view of a view
        out.append(v.cos())
        v[1:].add_(1)
    return torch.stack(out)


def boxes_near_the_end(x):
    # Sub-boxes whose enclosing dense box reaches past the storage's end:
    # the read pads that slack, so a runtime offset never shifts.
    n = x.shape[0]
    views = [x[i, 1:4, 2:5] for i in range(n)] + [x[n - 1, 3:, 3:], x[n - 1, 2:5, :3]]
    return torch.cat([(v * 1).flatten() for v in views])


def strided_gather_scatter(x):
    # Not a box (overlapping windows) on read; a stepped slice on write.
    out = [x[i].unfold(0, 4, 3).sum(1) for i in range(1, x.shape[0])]
    for i in range(1, x.shape[0]):
        x[i, 1::2].add_(10)
    return torch.cat(out)


def broadcast_elements(x):
    return torch.stack([x[i, j].expand(3, 2) + 0 for i in range(x.shape[0]) for j in range(x.shape[1])])


CASES = [
    ("rows_read", rows_read, [(6, 5)]),
    ("columns_read", columns_read, [(6, 5)]),
    ("diagonals_read", diagonals_read, [(4, 5)]),
    ("rows_add_", rows_add_, [(6, 5)]),
    ("columns_assign", columns_assign, [(6, 5), (6,)]),
    ("rows_copy_", rows_copy_, [(6, 5), (6, 5)]),
    ("diagonals_mul_", diagonals_mul_, [(4, 5)]),
    ("transposed_rows", transposed_rows, [(5, 4)]),
    ("views_of_views", views_of_views, [(8, 4, 5)]),
    ("boxes_near_the_end", boxes_near_the_end, [(3, 6, 5)]),
    ("strided_gather_scatter", strided_gather_scatter, [(4, 11)]),
    ("broadcast_elements", broadcast_elements, [(3, 4)]),
]


@pytest.mark.parametrize("name,fn,shapes", CASES, ids=[c[0] for c in CASES])
def test_slices_match_cpu(mode, name, fn, shapes):
    torch.manual_seed(0)
    check(fn, *[torch.randn(s) for s in shapes])


def test_channels_last_slices(mode):
    x = torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last)
    dev = x.to(DEVICE)
    assert dev.stride() == x.stride()
    expected = channels_last_slices(x)
    torch.testing.assert_close(channels_last_slices(dev).cpu(), expected)
    torch.testing.assert_close(dev.cpu(), x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float16, torch.uint8])
def test_dtypes(mode, dtype):
    x = torch.randint(0, 5, (5, 7)).to(dtype)
    check(lambda t: torch.stack([t[i] | t[i - 1] if dtype == torch.bool else t[i] + t[i - 1]
                                 for i in range(1, 5)]), x)
    check(lambda t: [t[i, 2:].fill_(i % 2) for i in range(5)][-1], x)


def test_partial_overlap_still_raises(mode):
    # The signature no longer tells these calls apart: the overlap check runs again.
    for x in (torch.arange(10.0), torch.arange(10.0).to(DEVICE)):
        torch.add(x[1:3], 1, out=x[4:6])
        with pytest.raises(RuntimeError, match="unsupported operation"):
            torch.add(x[1:3], 1, out=x[2:4])


def test_runtime_index_check_on_row_slices(mode):
    x = torch.randn(6, 3).to(DEVICE)
    idx = torch.tensor([[0, 1], [2, 5], [1, 9], [0, 0]]).to(DEVICE)
    with pytest.raises(IndexError, match="out of range"):
        for i in range(4):
            r = x.index_select(0, idx[i])
        torch.tpu.synchronize()
        r.cpu()
    good = torch.stack([x.index_select(0, idx[i]) for i in (0, 1, 3)])
    torch.testing.assert_close(good.cpu(), torch.stack([x.cpu().index_select(0, idx.cpu()[i]) for i in (0, 1, 3)]))


def compiles_of(fn):
    before = torch_pjrt.metrics()["compiles"]
    fn()
    torch.tpu.synchronize()
    return torch_pjrt.metrics()["compiles"] - before


def test_strict_compiles_do_not_grow_with_offsets():
    with torch_pjrt.mode("strict"):
        x = torch.randn(40, 13).to(DEVICE)  # a shape no other test uses

        def loop(rows):
            for i in rows:
                x[i].mul_(1.5)
                (x[i] + 1).neg_()

        # mul_ and add each: offset 0 and one runtime-offset program (neg_ of a fresh tensor: one).
        assert compiles_of(lambda: loop(range(20))) <= 5
        assert compiles_of(lambda: loop(range(20, 40))) == 0


@pytest.mark.parametrize("graph_mode", ["fused", "lazy"])
def test_fused_compiles_do_not_grow_with_offsets(graph_mode):
    with torch_pjrt.mode(graph_mode):
        x = torch.randn(40, 14).to(DEVICE)
        ref = x.cpu()

        def step(i):
            x[i] += x[i - 1] * 0.5
            torch_pjrt.sync()

        assert compiles_of(lambda: [step(i) for i in range(1, 6)]) <= 2
        assert compiles_of(lambda: [step(i) for i in range(6, 40)]) == 0
        for i in range(1, 40):
            ref[i] += ref[i - 1] * 0.5
        torch.testing.assert_close(x.cpu(), ref)


def test_fused_row_loop_donates_and_matches():
    with torch_pjrt.mode("fused"):
        x = torch.randn(64, 8).to(DEVICE)
        ref = x.cpu()
        torch_pjrt.sync()
        donated = torch_pjrt.metrics()["donated_buffers"]
        for i in range(64):
            x[i] += i
        torch_pjrt.sync()
        assert torch_pjrt.metrics()["donated_buffers"] > donated
        torch.testing.assert_close(x.cpu(), ref + torch.arange(64.0)[:, None])


def test_failed_graph_with_offsets_is_undone():
    cpu = torch.randn(5, 4)
    with torch_pjrt.mode("fused"):
        x = cpu.to(DEVICE)
        torch_pjrt.sync()
        torch_pjrt._C._inject_compile_fault("aten::exp")
        try:
            for i in range(1, 5):
                x[i].mul_(3)
                x[i - 1].copy_(torch.exp(x[i]))
            with pytest.raises(RuntimeError, match="aten::exp"):
                torch_pjrt.sync()
        finally:
            torch_pjrt._C._inject_compile_fault("")
        torch.testing.assert_close(x.cpu(), cpu, rtol=0, atol=0)  # every row update undone
        for i in range(1, 5):
            x[i].mul_(3)
        ref = cpu.clone()
        ref[1:] *= 3
        torch.testing.assert_close(x.cpu(), ref)


# ---- index_copy (lowered: no CPU fallback) ----------------------------------

INDEX_COPY_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                     torch.int8, torch.uint8, torch.bool]


def _values(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def _index_copy_fallbacks():
    return sum(n for op, n in torch_pjrt.metrics()["cpu_fallbacks"].items() if "index_copy" in op)


INDEX_COPY_CASES = [(dtype, 1) for dtype in INDEX_COPY_DTYPES] + [(torch.float32, 0), (torch.float32, 2),
                                                                   (torch.int64, -1)]


@pytest.mark.parametrize("dtype,dim", INDEX_COPY_CASES)
def test_index_copy_matches_cpu(mode, dtype, dim):
    torch.manual_seed(1)
    x = _values((4, 5, 6), dtype)
    index = torch.tensor([3, 0, 2])
    shape = list(x.shape)
    shape[dim] = 3
    src = _values(shape, dtype)
    fallbacks = _index_copy_fallbacks()
    check(lambda t, s: t.index_copy_(dim, index.to(t.device), s), x, src)
    check(lambda t, s: torch.index_copy(t, dim, index.to(t.device), s), x, src)
    check(lambda t, s: torch.index_copy(t, dim, index.to(t.device), s, out=torch.empty_like(t)), x, src)
    assert _index_copy_fallbacks() == fallbacks


def test_index_copy_edge_cases(mode):
    # Repeated indices: the CPU's loop leaves the last copy.
    check(lambda t: t.index_copy_(0, torch.tensor([1, 3, 1, 1]).to(t.device), torch.arange(8.0).reshape(4, 2)
                                  .to(t.device)), torch.zeros(5, 2))
    # 0-d self and 0-d source; a view at a nonzero offset; an empty index.
    check(lambda t: t.index_copy_(0, torch.tensor([0]).to(t.device), torch.tensor(5.0).to(t.device)), torch.zeros(()))
    check(lambda t: t[2:].index_copy_(1, torch.tensor([2, 0]).to(t.device), -t[:4, 1:].clone()), torch.randn(6, 3))
    check(lambda t: t.index_copy_(0, torch.tensor([], dtype=torch.long).to(t.device), t[:0]), torch.randn(3, 2))


@pytest.mark.parametrize("dim,bad", [(0, 5), (0, -1), (1, 4)])
def test_index_copy_out_of_range_raises(mode, dim, bad):
    def fn(x, i):
        return x.index_copy_(dim, i, torch.ones((2, 4) if dim == 0 else (3, 2), device=x.device))

    with pytest.raises(IndexError) as expected:
        fn(torch.zeros(3, 4), torch.tensor([0, bad]))
    with pytest.raises(IndexError) as actual:
        fn(torch.zeros(3, 4, device=DEVICE), torch.tensor([0, bad], device=DEVICE)).cpu()
    assert str(expected.value) in str(actual.value)
    x = torch.zeros(3, 4, device=DEVICE)  # usable afterwards
    fn(x, torch.tensor([0, 1], device=DEVICE))
    torch.testing.assert_close(x.cpu(), fn(torch.zeros(3, 4), torch.tensor([0, 1])))
