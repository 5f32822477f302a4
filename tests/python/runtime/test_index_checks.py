"""Out-of-range indices and integer division by zero raise the CPU's error in every mode.

XLA clamps out-of-range gather indices and drops out-of-range scatter updates.
Each lowering declares a check computed inside its own program (or the fused
graph); the host reads it at its next wait (a data read, synchronize) and
raises the CPU's exception naming the op and the user's line. Debug mode
waits after every op, so there the error comes from the op's own line.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt
from conftest import DEVICE, to_dev

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

MODES = ["strict", "fused", "lazy", "debug"]
HERE = os.path.basename(__file__)


@pytest.fixture(params=MODES)
def mode(request):
    with torch_pjrt.mode(request.param):
        yield request.param


def _src(x, i):
    return torch.ones(i.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)


def _line_of(marker):
    """file:line of the line in this file that ends with `marker`."""
    with open(__file__) as f:
        lines = [n for n, text in enumerate(f, 1) if text.rstrip().endswith(marker)]
    assert len(lines) == 1, marker
    return f"{HERE}:{lines[0]}"


# (name, op named in the error, fn(x, index) written on one line so that its
#  first line is the line of the offending call, good index, bad index).
# x is arange(20.).reshape(5, 4).
CASES = [
    ("getitem", "aten::index.Tensor", lambda x, i: x[i], [0, -1, 4, -5], [0, 5]),
    ("getitem_negative", "aten::index.Tensor", lambda x, i: x[i], [-5, 2], [1, -6]),
    ("getitem_two_dims", "aten::index.Tensor", lambda x, i: x[i, i.abs() % 4], [1, -2], [3, 7]),
    ("getitem_second_dim", "aten::index.Tensor", lambda x, i: x[:, i], [3, -4], [0, 4]),
    ("index_select", "aten::index_select", lambda x, i: x.index_select(0, i), [4, 0, 2], [0, 5]),
    ("index_select_negative", "aten::index_select", lambda x, i: x.index_select(0, i), [1], [-1]),
    ("index_select_dim1", "aten::index_select", lambda x, i: x.index_select(1, i), [3, 0], [4]),
    ("embedding", "aten::index_select", lambda x, i: F.embedding(i, x), [4, 1, 1], [2, 9]),
    ("gather", "aten::gather", lambda x, i: x.gather(1, i.reshape(-1, 1).expand(-1, 2)[:5]), [3, 0], [1, 4]),
    ("gather_negative", "aten::gather", lambda x, i: x.gather(0, i.reshape(-1, 1)), [2], [-1]),
    ("setitem", "aten::index_put_", lambda x, i: (y := x.clone()).__setitem__(i, 7.0) or y, [1, -1], [2, 8]),
    ("setitem_negative", "aten::index_put_", lambda x, i: (y := x.clone()).__setitem__(i, 7.0) or y, [-5], [-6]),
    ("index_put_accumulate", "aten::index_put_", lambda x, i: x.clone().index_put_((i,), _src(x, i), accumulate=True), [1, 1, -2], [5]),
    ("scatter", "aten::scatter", lambda x, i: x.clone().scatter_(0, i.reshape(-1, 1), _src(x, i)[:, :1]), [4, 2], [0, 5]),
    ("scatter_value", "aten::scatter", lambda x, i: x.clone().scatter_(1, i.reshape(1, -1), 3.0), [0, 3], [4]),
    ("scatter_negative", "aten::scatter", lambda x, i: x.clone().scatter_(0, i.reshape(-1, 1), 3.0), [1], [-1]),
    ("scatter_add", "aten::scatter_add", lambda x, i: x.clone().scatter_add_(0, i.reshape(-1, 1), _src(x, i)[:, :1]), [1, 1], [6]),
    ("scatter_reduce", "aten::scatter_reduce", lambda x, i: x.clone().scatter_reduce_(0, i.reshape(-1, 1), _src(x, i)[:, :1], "amax"), [0, 3], [3, 5]),
    ("index_reduce", "aten::index_reduce", lambda x, i: x.clone().index_reduce_(0, i, _src(x, i), "prod"), [0, 4], [5]),
    ("take", "aten::index.Tensor", lambda x, i: x.take(i), [0, 19, -20], [20]),
    ("cross_entropy", "aten::nll_loss_forward", lambda x, i: F.cross_entropy(x[:2], i), [3, 0], [1, 4]),
    ("cross_entropy_negative", "aten::nll_loss_forward", lambda x, i: F.cross_entropy(x[:2], i), [3, 0], [-1, 2]),
]


def _cpu_message(fn, x, bad):
    try:
        fn(x, bad)
    except (IndexError, RuntimeError) as e:
        return str(e)


def _cpu_error(fn, x, bad):
    with pytest.raises((IndexError, RuntimeError)) as info:
        fn(x, bad)
    return info.type


@pytest.mark.parametrize("name,op,fn,good,bad", CASES, ids=[c[0] for c in CASES])
def test_in_range_indices_match_cpu(mode, name, op, fn, good, bad):
    x = torch.arange(20.0).reshape(5, 4)
    i = torch.tensor(good)
    torch.testing.assert_close(fn(*to_dev((x, i))).cpu(), fn(x, i))


@pytest.mark.parametrize("name,op,fn,good,bad", CASES, ids=[c[0] for c in CASES])
def test_out_of_range_raises_the_cpu_error_at_the_next_read(mode, name, op, fn, good, bad):
    x = torch.arange(20.0).reshape(5, 4)
    bad = torch.tensor(bad)
    error = _cpu_error(fn, x, bad)  # the reference: what the CPU raises
    line = f"{HERE}:{fn.__code__.co_firstlineno}"
    xd, bd = to_dev((x, bad))
    if mode == "debug":  # debug waits after each op: the op's own call raises
        with pytest.raises(error) as info:
            fn(xd, bd)
    else:
        y = fn(xd, bd)  # nothing waits yet
        with pytest.raises(error) as info:
            y.cpu()
    message = str(info.value)
    if mode == "debug" and message == _cpu_message(fn, x, bad):
        pass  # raised synchronously at the call above by the CPU kernel itself, with CPU's exact message
    else:
        assert op in message and line in message, message
    # The state recovers: nothing is left pending, later work is right.
    z = torch.arange(6, device=DEVICE) * 2
    assert z.cpu().tolist() == [0, 2, 4, 6, 8, 10]
    torch.testing.assert_close(fn(xd, torch.tensor(good, device=DEVICE)).cpu(), fn(x, torch.tensor(good)))


def test_the_message_has_the_bad_value_and_the_cpu_text(mode):
    x = torch.arange(10.0, device=DEVICE)
    with pytest.raises(IndexError, match="index 12 is out of bounds for dimension 0 with size 10") as info:
        x[torch.tensor([3, 12, 15], device=DEVICE)].cpu()
    assert "aten::index.Tensor(Float[10], Long[3])" in str(info.value)
    with pytest.raises(IndexError, match=r"^index out of range in self"):
        x.reshape(5, 2).index_select(0, torch.tensor([-1], device=DEVICE)).cpu()


def test_error_raises_at_synchronize(mode):
    x = torch.arange(10.0, device=DEVICE)
    i = torch.tensor([10], device=DEVICE)
    if mode == "debug":
        with pytest.raises(IndexError):
            x[i]
        return
    y = x[i]  # noqa: F841
    with pytest.raises(IndexError, match=f"{HERE}:"):
        torch.tpu.synchronize()
    torch.tpu.synchronize()  # reported once


def test_an_unrelated_read_reports_an_earlier_failure():
    # Strict mode runs each op at once: the next wait, whatever it reads, reports it.
    with torch_pjrt.mode("strict"):
        x = torch.arange(10.0, device=DEVICE)
        y = x[torch.tensor([11], device=DEVICE)]  # noqa: F841  # bad-unrelated
        with pytest.raises(IndexError, match=_line_of("# bad-unrelated")):
            (x + 1).cpu()
        assert (x + 1).cpu().tolist() == list(range(1, 11))


def test_each_failed_program_raises_at_a_wait():
    # Two bad ops in two programs: the first wait raises the first, the next wait the second (a second bad
    # result never reads as clamped values without an error).
    with torch_pjrt.mode("strict"):
        x = torch.arange(20.0, device=DEVICE).reshape(10, 2)
        a = x[torch.tensor([1, 10], device=DEVICE)]  # bad-first
        b = x[torch.tensor([-19, 0], device=DEVICE)]  # bad-second
        with pytest.raises(IndexError, match=f"index 10 .*{_line_of('# bad-first')}"):
            a.cpu()
        with pytest.raises(IndexError, match=f"index -19 .*{_line_of('# bad-second')}"):
            b.cpu()
        assert x.sum().item() == 190.0  # nothing left pending


@pytest.mark.parametrize("graph_mode", ["fused", "lazy"])
def test_a_graph_names_the_first_failing_op(graph_mode):
    with torch_pjrt.mode(graph_mode):
        x = torch.arange(12.0, device=DEVICE).reshape(4, 3)
        a = x[torch.tensor([1, 2], device=DEVICE)] * 2  # fine
        b = a.index_select(0, torch.tensor([0, 2], device=DEVICE))  # 2 is out of range  # first-bad
        c = x.gather(1, torch.tensor([[5]], device=DEVICE))  # also bad, recorded later
        with pytest.raises(IndexError, match=f"aten::index_select.*{_line_of('# first-bad')}"):
            (b.sum() + c.sum()).item()
        assert torch_pjrt.get_mode() == graph_mode
        torch.testing.assert_close(a.cpu(), torch.tensor([[6.0, 8, 10], [12, 14, 16]]))


def test_embedding_backward_with_bad_indices(mode):
    torch.manual_seed(0)
    w = torch.randn(6, 3, requires_grad=True)
    wd = to_dev(w)
    good = torch.tensor([[0, 5, 5], [2, -0, 1]])
    F.embedding(good, w).pow(2).sum().backward()
    F.embedding(good.to(DEVICE), wd).pow(2).sum().backward()
    torch.testing.assert_close(wd.grad.cpu(), w.grad)

    bad = torch.tensor([[0, 6]], device=DEVICE)
    with pytest.raises(IndexError, match=f"aten::index_select.*{_line_of('# bad-embedding')}"):
        F.embedding(bad, wd).sum().backward()  # bad-embedding
        wd.grad.cpu()
    # Padding rows take no gradient, as on the CPU.
    ref = torch.zeros(6, 3, requires_grad=True)
    F.embedding(good, ref, padding_idx=5).sum().backward()
    dev = to_dev(torch.zeros(6, 3, requires_grad=True))
    F.embedding(good.to(DEVICE), dev, padding_idx=5).sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), ref.grad)


@pytest.mark.parametrize("name,fn", [
    ("index_add", lambda x, i: x.clone().index_add_(0, i, _src(x, i))),
    ("index_copy", lambda x, i: x.clone().index_copy_(0, i, _src(x, i))),
    ("index_fill", lambda x, i: x.clone().index_fill_(0, i, 2.0)),
    ("put", lambda x, i: x.clone().put_(i, torch.ones(i.shape, device=x.device))),
])
def test_ops_running_on_the_cpu_raise_too(mode, name, fn):
    # Not lowered: they run on the CPU (counted fallbacks), whose kernels check.
    x = torch.arange(20.0).reshape(5, 4)
    good, bad = torch.tensor([1, 3]), torch.tensor([2, 25])
    torch.testing.assert_close(fn(*to_dev((x, good))).cpu(), fn(x, good))
    error = _cpu_error(fn, x, bad)
    with pytest.raises(error):
        fn(*to_dev((x, bad))).cpu()


# ---- integer division by zero ----------------------------------------------

DIVISIONS = [
    ("floor_divide", lambda a, b: a // b),
    ("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    ("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor")),
    ("remainder", lambda a, b: a % b),
    ("fmod", lambda a, b: torch.fmod(a, b)),
]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("name,fn", DIVISIONS, ids=[d[0] for d in DIVISIONS])
def test_integer_division_by_zero(mode, name, fn, dtype):
    a = torch.tensor([7, 9, 100, 3], dtype=dtype)
    if dtype != torch.uint8:
        a = a * torch.tensor([1, -1, 1, -1], dtype=dtype)
    b = torch.tensor([2, 4, 3, 0], dtype=dtype)
    ok = torch.tensor([2, 4, 3, 5], dtype=dtype)
    torch.testing.assert_close(fn(*to_dev((a, ok))).cpu(), fn(a, ok))
    with pytest.raises(RuntimeError) as cpu:
        fn(a, b)
    assert str(cpu.value) == "ZeroDivisionError"
    line = f"{HERE}:{DIVISIONS[[d[0] for d in DIVISIONS].index(name)][1].__code__.co_firstlineno}"
    with pytest.raises(RuntimeError, match=f"^ZeroDivisionError .*{line}"):
        fn(*to_dev((a, b))).cpu()
    with pytest.raises(RuntimeError, match="^ZeroDivisionError"):
        fn(a.to(DEVICE), 0).cpu()  # a Scalar divisor, a runtime operand
    torch.testing.assert_close(fn(a.to(DEVICE), 3).cpu(), fn(a, 3))


def test_float_division_by_zero_is_not_an_error(mode):
    a = torch.tensor([1.0, -1.0, 0.0])
    b = torch.zeros(3)
    for fn in (lambda a, b: a / b, lambda a, b: a // b, lambda a, b: a % b, torch.fmod,
               lambda a, b: torch.tensor([3, 4]).to(a.device) / torch.tensor([0, 0]).to(a.device)):
        torch.testing.assert_close(fn(*to_dev((a, b))).cpu(), fn(a, b), equal_nan=True)


def test_a_fused_step_reads_one_check_status():
    # Cost: every check of a graph folds into one tiny status, read once at the next wait.
    with torch_pjrt.mode("fused"):
        emb = torch.nn.Embedding(16, 8).to(DEVICE)
        head = torch.nn.Linear(8, 16).to(DEVICE)
        opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
        idx = torch.randint(0, 16, (4, 6)).to(DEVICE)
        for _ in range(2):
            before = torch_pjrt.metrics()["check_status_reads"]
            opt.zero_grad()
            loss = F.cross_entropy(head(emb(idx)).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()  # ends the graph
            loss.item()
            assert torch_pjrt.metrics()["check_status_reads"] - before == 1


@pytest.mark.parametrize("mode", MODES)
def test_constant_indices_do_not_fail_their_check(mode):
    # A torch.zeros index is a constant inside a fused graph; its check must
    # still pass (it once read as a failure).
    with torch_pjrt.mode(mode):
        a = torch.arange(6.0).reshape(2, 3).to("tpu")
        r = a[torch.zeros(1, dtype=torch.long, device="tpu")]
        s = a[torch.tensor(True, device="tpu"), torch.tensor(True, device="tpu")]
        q = torch.arange(6, device="tpu") // torch.full((6,), 2, dtype=torch.long, device="tpu")
        torch.testing.assert_close(r.cpu(), torch.arange(6.0).reshape(2, 3)[[0]])
        assert s.cpu().shape == (1, 2, 3)
        torch.testing.assert_close(q.cpu(), torch.arange(6) // 2)


@pytest.mark.parametrize("msg", [None, "position_ids exceed max_valid_pos=3"])
def test_assert_async_raises_cpus_message_at_next_wait(mode, msg):
    """torch._assert_async on tpu is a runtime check (torchtitan's RoPE bound): no wait, no CPU fallback, the
    CPU's message at the next wait when the one value is zero; true, nonzero and NaN values pass, as on the CPU."""
    before = torch_pjrt.metrics()["cpu_fallbacks"].get("aten::_assert_async.msg", 0)
    x = torch.arange(5, device=DEVICE)
    args = (msg,) if msg else ()
    torch._assert_async(torch.all(x <= 4), *args)
    torch._assert_async(torch.tensor(2.5, device=DEVICE), *args)
    torch._assert_async(torch.tensor(float("nan"), device=DEVICE), *args)
    assert (x * 2).sum().item() == 20
    want = msg or "Expected Tensor with single nonzero value, but got zero"
    with pytest.raises(RuntimeError) as cpu:
        torch._assert_async(torch.all(torch.arange(5) <= 3), *args)
    assert str(cpu.value) == want
    with pytest.raises(RuntimeError, match=want) as err:
        torch._assert_async(torch.all(x <= 3), *args)  # assert_async fails here
        torch.tpu.synchronize()
    assert "_assert_async" in str(err.value) and _line_of("# assert_async fails here") in str(err.value)
    assert torch_pjrt.metrics()["cpu_fallbacks"].get("aten::_assert_async.msg", 0) == before
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):  # as the CPU, at the op
        torch._assert_async(torch.ones(2, device=DEVICE), *args)
