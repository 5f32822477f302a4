"""torch.tpu.ops' portable SparseCore ops (python/torch_pjrt/torchtpu/_sparsecore.py) against NumPy loops.

Each case runs on tpu and checks that nothing fell back to the CPU (torch_pjrt.metrics()["cpu_fallbacks"]).
"""
import numpy as np
import pytest
import torch

import torch_pjrt
from torch_pjrt import torchtpu  # noqa: F401  (installs torch.tpu.ops)

DEVICE = "tpu"
TOL = dict(atol=1e-5, rtol=1e-5)
PAD = 2**31 - 1


def _ops():
    import torch.tpu.ops as ops

    return ops


def _run(fn):
    """fn() on tpu, synchronized, with no CPU fallback."""
    torch_pjrt.sync()
    torch_pjrt.reset_metrics()
    out = fn()
    torch_pjrt.sync()
    assert not torch_pjrt.metrics()["cpu_fallbacks"], torch_pjrt.metrics()["cpu_fallbacks"]
    return out


def _csr():
    # 3 rows of at most 4 non-zeroes: lengths 2, 0, 3 -> ends 2, 2, 5; positions 5..11 are padding
    row_pointers = torch.tensor([2, 2, 5], dtype=torch.int32)
    indices = torch.tensor([4, 1, 0, 4, 6, PAD, 0, 0, 3, 1, 2, 2])
    return row_pointers, indices


def test_sparse_iota_positions_within_rows():
    row_pointers, _ = _csr()
    got = _run(lambda: _ops().sparse_iota(row_pointers.to(DEVICE), 12, 4).cpu())
    ends = row_pointers.numpy()
    want = []
    for j in range(12):
        start = max([0] + [e for e in ends if e <= j])
        want.append(j - start if j < ends[-1] else -1)
    assert got.dtype == torch.int32 and got.tolist() == want == [0, 1, 0, 1, 2] + [-1] * 7
    with pytest.raises(TypeError, match="int32"):
        _ops().sparse_iota(row_pointers.long(), 12, 4)


def test_sparse_gather_forward_backward_and_autograd():
    ops = _ops()
    row_pointers, indices = _csr()
    operand = torch.randn(7, 5)
    got = _run(lambda: ops.sparse_gather(row_pointers.to(DEVICE), indices.to(DEVICE), operand.to(DEVICE), 4).cpu())
    want = np.zeros((12, 5), np.float32)
    for j in range(int(row_pointers[-1])):
        want[j] = operand.numpy()[indices[j]]
    np.testing.assert_allclose(got.numpy(), want, **TOL)

    grad_out, base = torch.randn(12, 5), torch.randn(7, 5)
    got = _run(lambda: ops.sparse_gather_backward(grad_out.to(DEVICE), indices.to(DEVICE), base.to(DEVICE)).cpu())
    want = base.numpy().copy()
    for j, i in enumerate(indices.tolist()):
        if 0 <= i < 7:
            want[i] += grad_out.numpy()[j]
    np.testing.assert_allclose(got.numpy(), want, **TOL)

    # autograd through the forward: the padding positions get no gradient
    x = operand.to(DEVICE).requires_grad_(True)
    _run(lambda: ops.sparse_gather(row_pointers.to(DEVICE), indices.to(DEVICE), x, 4).mul(grad_out.to(DEVICE))
         .sum().backward())
    want = np.zeros((7, 5), np.float32)
    for j in range(int(row_pointers[-1])):
        want[indices[j]] += grad_out.numpy()[j]
    np.testing.assert_allclose(x.grad.cpu().numpy(), want, **TOL)
    with pytest.raises(ValueError, match="indices length"):
        ops.sparse_gather(row_pointers, indices[:8], operand, 4)


def _entries(batch=4, rows=6, n=10, pad=3):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (n,), generator=g, dtype=torch.int32)
    samples = torch.randint(0, batch, (n,), generator=g, dtype=torch.int32)
    gains = torch.rand(n, generator=g) + 0.5
    ids[-pad:], samples[-pad:] = PAD, PAD  # SparseCore's padding entries
    row_pointers = torch.tensor([n - pad], dtype=torch.int32)
    return row_pointers, ids, samples, gains


def _np_matmul(ids, samples, gains, table, batch):
    out = np.zeros((batch, table.shape[1]), np.float32)
    for i, s, w in zip(ids.tolist(), samples.tolist(), gains.tolist()):
        if i < table.shape[0] and s < batch:
            out[s] += w * table[i]
    return out


def _np_grad(ids, samples, gains, table, act_grad):
    grad, touched = np.zeros_like(table), np.zeros(table.shape[0], bool)
    for i, s, w in zip(ids.tolist(), samples.tolist(), gains.tolist()):
        if i < table.shape[0] and s < act_grad.shape[0]:
            grad[i] += w * act_grad[s]
            touched[i] = True
    return grad, touched


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


def test_sparse_dense_matmul_and_its_gradient():
    ops = _ops()
    rp, ids, samples, gains = _entries()
    table = torch.randn(6, 8)
    got = _run(lambda: ops.sparse_dense_matmul(*_dev(rp, ids, samples, gains, table), 4, 16, 16).cpu())
    np.testing.assert_allclose(got.numpy(), _np_matmul(ids, samples, gains, table.numpy(), 4), **TOL)
    # its autograd gradient is the gain-weighted scatter-add of the activations' gradient
    act_grad = torch.randn(4, 8)
    t = table.to(DEVICE).requires_grad_(True)
    _run(lambda: ops.sparse_dense_matmul(*_dev(rp, ids, samples, gains), t, 4, 16, 16).mul(act_grad.to(DEVICE))
         .sum().backward())
    grad, _ = _np_grad(ids, samples, gains, table.numpy(), act_grad.numpy())
    np.testing.assert_allclose(t.grad.cpu().numpy(), grad, **TOL)


def test_sparse_dense_matmul_fused_optimizer_updates():
    ops = _ops()
    rp, ids, samples, gains = _entries()
    table, act_grad = torch.randn(6, 8), torch.randn(4, 8)
    grad, touched = _np_grad(ids, samples, gains, table.numpy(), act_grad.numpy())
    assert not touched.all()  # some rows are untouched: the sparse updates leave them alone
    lr = torch.tensor(0.1)
    common = _dev(rp, ids, samples, gains, table)

    got = _run(lambda: ops.sparse_dense_matmul_grad_with_sgd(*common, act_grad.to(DEVICE), lr.to(DEVICE), 4, 16, 16,
                                                             "sgd").cpu())
    np.testing.assert_allclose(got.numpy(), table.numpy() - 0.1 * grad, **TOL)

    for acc in (torch.rand(6, 8), torch.rand(6)):
        new_t, new_acc = _run(lambda: [r.cpu() for r in ops.sparse_dense_matmul_grad_with_adagrad(
            *common, acc.to(DEVICE), act_grad.to(DEVICE), lr.to(DEVICE), 1e-3, 4, 16, 16, "adagrad")])
        a = acc.numpy().copy()
        if a.ndim == 1:
            a[touched] += (grad * grad).mean(1)[touched]
            denom = np.sqrt(a)[:, None] + 1e-3
        else:
            a[touched] += (grad * grad)[touched]
            denom = np.sqrt(a) + 1e-3
        want_t = table.numpy() - np.where(touched[:, None], 0.1 * grad / denom, 0)
        np.testing.assert_allclose(new_acc.numpy(), a, **TOL)
        np.testing.assert_allclose(new_t.numpy(), want_t, **TOL)

    m0, v0 = torch.randn(6, 8), torch.rand(6, 8)
    b1, b2, eps = 0.9, 0.99, 1e-6
    new_t, m, v = _run(lambda: [r.cpu() for r in ops.sparse_dense_matmul_grad_with_adam(
        *common, m0.to(DEVICE), v0.to(DEVICE), act_grad.to(DEVICE), torch.tensor(0.01).to(DEVICE), b1, b2, eps, 4,
        16, 16, "adam")])
    want_m = np.where(touched[:, None], b1 * m0.numpy() + (1 - b1) * grad, m0.numpy())
    want_v = np.where(touched[:, None], b2 * v0.numpy() + (1 - b2) * grad * grad, v0.numpy())
    want_t = np.where(touched[:, None], table.numpy() - 0.01 * want_m / (np.sqrt(want_v) + eps), table.numpy())
    np.testing.assert_allclose(m.numpy(), want_m, **TOL)
    np.testing.assert_allclose(v.numpy(), want_v, **TOL)
    np.testing.assert_allclose(new_t.numpy(), want_t, **TOL)


def test_activation_unstack_and_gradient_stack_are_inverse():
    ops = _ops()
    stacked = torch.randn(7, 6)
    parts = _run(lambda: [p.cpu() for p in ops.sparse_dense_matmul_activation_unstack(stacked.to(DEVICE), [3, 4],
                                                                                       [6, 2])])
    assert [tuple(p.shape) for p in parts] == [(3, 6), (4, 2)]
    np.testing.assert_array_equal(parts[0].numpy(), stacked.numpy()[:3])
    np.testing.assert_array_equal(parts[1].numpy(), stacked.numpy()[3:, :2])
    grads = [torch.randn(3, 6), torch.randn(4, 2)]
    got = _run(lambda: ops.sparse_dense_matmul_gradient_stack(_dev(*grads), 7, 6).cpu())
    want = np.zeros((7, 6), np.float32)
    want[:3], want[3:, :2] = grads[0].numpy(), grads[1].numpy()
    np.testing.assert_array_equal(got.numpy(), want)
    # the unstack's autograd backward is that stack
    x = stacked.to(DEVICE).requires_grad_(True)
    _run(lambda: sum((p * g.to(DEVICE)).sum() for p, g in zip(
        ops.sparse_dense_matmul_activation_unstack(x, [3, 4], [6, 2]), grads)).backward())
    np.testing.assert_array_equal(x.grad.cpu().numpy(), want)
    with pytest.raises(ValueError, match="total stacked batch size"):
        ops.sparse_dense_matmul_activation_unstack(stacked, [3, 3], [6, 2])
    with pytest.raises(TypeError, match="float32"):
        ops.sparse_dense_matmul_activation_unstack(stacked.double(), [3, 4], [6, 2])
