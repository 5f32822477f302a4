"""Regressions found by PyTorch's own device-generic tests on `tpu` (second round).

Each test compares with CPU PyTorch: the same values and layout, or the same
error type and message, as the CPU kernel.
"""
import warnings

import pytest
import torch
import torch_pjrt  # noqa: F401
from conftest import assert_same_error

warnings.filterwarnings("ignore", message="torch_pjrt:")


# ---- error types: importing torch_pjrt must not turn c10 errors into RuntimeError ----

def test_cpu_op_errors_keep_their_python_type():
    # The extension's exception translator used to be global (pybind11 shares
    # it with torch's own bindings): every NotImplementedError became a RuntimeError.
    with pytest.raises(NotImplementedError, match="not implemented for 'Int'"):
        torch.ops.aten.adaptive_max_pool2d(torch.ones(4, 4, 4, dtype=torch.int32), [2, 2])


@pytest.mark.parametrize("pool", ["adaptive_max_pool2d", "adaptive_max_pool3d", "adaptive_avg_pool2d",
                                  "adaptive_avg_pool3d"])
def test_integer_adaptive_pools_raise_cpu_error_type(pool):
    # Through a decomposition's CPU fallback (the max pools) and through the executor (the avg pools).
    dims = 3 if pool.endswith("2d") else 4
    x = torch.ones((4,) * dims, dtype=torch.int32)
    assert_same_error(lambda t: getattr(torch.nn.functional, pool)(t, 2), x)


def test_runtime_index_check_is_still_an_index_error():
    x = torch.arange(3.0, device="tpu")
    # Debug mode waits at every op, so the error may come from the op itself rather than the next wait.
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 3"):
        x[torch.tensor([5], device="tpu")]
        torch.tpu.synchronize()


# ---- device mix-ups through the CPU fallback: out= on the CPU ----

def test_nonzero_with_cpu_out_raises_device_error():
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]], device="tpu")
    with pytest.raises(RuntimeError, match="on the same device"):
        torch.nonzero(x, out=torch.empty(0, dtype=torch.long))


def test_nonzero_with_tpu_out_matches_cpu():
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0], [3.0, 4.0]])
    out = torch.empty(0, dtype=torch.long, device="tpu")
    got = torch.nonzero(x.to("tpu"), out=out)
    assert got is out
    torch.testing.assert_close(out.cpu(), torch.nonzero(x))


# ---- mode: its out= form's generic kernel rejects devices other than CPU/CUDA/XPU ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_mode_out_matches_cpu(dtype):
    x = torch.tensor([[1, 2, 2, 3], [4, 4, 1, 1]], dtype=dtype)
    values, indices = torch.empty(0, dtype=dtype, device="tpu"), torch.empty(0, dtype=torch.long, device="tpu")
    torch.mode(x.to("tpu"), 1, out=(values, indices))
    expected = torch.mode(x, 1)
    torch.testing.assert_close(values.cpu(), expected.values)
    torch.testing.assert_close(indices.cpu(), expected.indices)


# ---- dtype checks in CPU kernel bodies that no meta kernel makes ----

def test_bool_relu_raises_cpu_error():
    x = torch.tensor([True, False])
    assert_same_error(torch.relu, x)
    assert_same_error(lambda t: torch.nn.functional.relu(t, inplace=True), x)


def test_integer_ops_with_data_dependent_stand_in_errors_still_run():
    # Stand-in zeros would divide by zero; only an error raised for ones and zeros alike is the CPU's verdict.
    a = torch.tensor([7, -7, 9], dtype=torch.int32)
    b = torch.tensor([2, 3, -4], dtype=torch.int32)
    for fn in (torch.remainder, torch.fmod, lambda x, y: torch.div(x, y, rounding_mode="floor")):
        torch.testing.assert_close(fn(a.to("tpu"), b.to("tpu")).cpu(), fn(a, b))


# ---- layouts: 3-d max pools of an unbatched channels_last input ----

@pytest.mark.parametrize("channels_last", [True, False])
def test_unbatched_max_pool3d_layout_matches_cpu(channels_last):
    torch.manual_seed(0)
    x = torch.randn(1, 6, 14, 12, 13)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    x = x[0]
    results = []
    for device in ("cpu", "tpu"):
        t = x.detach().to(device).requires_grad_()
        out, ind = torch.nn.functional.max_pool3d(t, (5, 6, 7), return_indices=True)
        out.backward(torch.ones_like(out))
        results.append((out, ind, t.grad))
    for cpu, tpu in zip(*results):
        assert tpu.stride() == cpu.stride()
        torch.testing.assert_close(tpu.detach().cpu(), cpu.detach())


# ---- index checks: host-held indices raise at the op; messages number the indexed dims as the CPU does ----

@pytest.mark.parametrize("case", [
    lambda x, i: x[i([1, 5])],
    lambda x, i: x[i([0]), :, i([9])],
    lambda x, i: x[:, :, i([-5])],
    lambda x, i: x.index_put_((i([0]), i([3])), torch.tensor(1.0, device=x.device)),
])
def test_cpu_index_tensors_raise_at_the_op(case):
    x = torch.zeros(2, 3, 4)
    with pytest.raises(IndexError) as cpu:
        case(x, torch.tensor)
    with pytest.raises(IndexError) as tpu:
        case(x.to("tpu"), torch.tensor)  # the CPU index tensors are on the host: no wait needed
    assert str(cpu.value).split("\n")[0] in str(tpu.value)
    torch.tpu.synchronize()  # nothing left pending


def test_device_index_check_numbers_indexed_dims_like_cpu():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(IndexError) as cpu:
        x[:, :, torch.tensor([9])]
    with pytest.raises(IndexError) as tpu:
        x.to("tpu")[:, :, torch.tensor([9], device="tpu")]
        torch.tpu.synchronize()
    assert str(cpu.value).split("\n")[0] in str(tpu.value)


def test_index_put_with_indices_that_do_not_broadcast_raises_cpu_index_error():
    # The value-shape check asked the meta kernel (a Python reference: RuntimeError) before the CPU kernel.
    a = torch.zeros(5, 5)
    assert_same_error(lambda t: t.__setitem__(([0, 1], [0, 1, 2]), 0), a)
    assert_same_error(lambda t: t[[0, 1], [0, 1, 2]], a)
    i, j = torch.tensor([0, 1]), torch.tensor([0, 1, 2])
    assert_same_error(lambda t: t.index_put_((i.to(t.device), j.to(t.device)), torch.tensor(1.0, device=t.device)), a)


# ---- boolean masks expanded on the device: CPU's warning and check order ----

def test_uint8_mask_warns_like_cpu():
    def warnings_of(device):
        x = torch.arange(6.0, device=device).reshape(2, 3)
        mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8, device=device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = x[mask].cpu()
        return values, sum("torch.uint8 is now deprecated" in str(w.message) for w in caught)

    cpu_values, cpu_count = warnings_of("cpu")
    tpu_values, tpu_count = warnings_of("tpu")
    torch.testing.assert_close(tpu_values, cpu_values)
    assert tpu_count == cpu_count == 1


@pytest.mark.parametrize("value", [[], [1.0, 2.0, 3.0]])
def test_mask_assignment_checks_shape_before_dtype(value):
    def assign(a, v):
        a[a > -1] = v
        return a

    assert_same_error(assign, torch.arange(0, 4), torch.tensor(value))
