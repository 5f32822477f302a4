"""Eager semantics: storage-sharing views, in-place ops through views, autograd."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_matches_cpu, to_dev


def both(x):
    return x.clone(), x.to("tpu")


def test_view_writes_update_base():
    c, t = both(torch.arange(24.0).reshape(4, 6))
    for x in (c, t):
        x[1].add_(100)
        x[:, 2].mul_(-1)
        x.t()[3, 1:3] = 7.0
        x.view(24)[::5].zero_()
        x.diagonal().fill_(0.5)
        x[2:, ::2] += torch.ones(2, 3, device=x.device)
    torch.testing.assert_close(t.cpu(), c)


def test_views_share_storage():
    t = torch.zeros(3, 4, device="tpu")
    v = t.view(12)
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    v[5] = 3.0
    assert t[1, 1].item() == 3.0
    s = t[:, 1:3]
    assert not s.is_contiguous() and s.storage_offset() == 1
    s.copy_(torch.full((3, 2), 2.0))
    assert t.sum().item() == 12.0 and t[1, 1].item() == 2.0


def test_inplace_on_noncontiguous_and_expanded_sources():
    c, t = both(torch.randn(5, 4))
    for x in (c, t):
        x.t().add_(torch.arange(5.0, device=x.device))
        x.unsqueeze(0)[0, :, 1].sub_(x[:, 0].clone())
    torch.testing.assert_close(t.cpu(), c)


def test_copy_between_devices_and_dtypes():
    t = torch.zeros(3, 4, dtype=torch.float64, device="tpu")
    t[1:].copy_(torch.arange(8, dtype=torch.int32).reshape(2, 4))
    torch.testing.assert_close(t.cpu(), torch.cat([torch.zeros(1, 4), torch.arange(8.0).reshape(2, 4)]).double())
    dst = torch.empty(2, 4)
    dst.copy_(t[1:])
    torch.testing.assert_close(dst, torch.arange(8.0).reshape(2, 4))


def test_resize_and_out_variants():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.empty(0, device="tpu")
    torch.add(a.to("tpu"), b.to("tpu"), out=out)
    torch.testing.assert_close(out.cpu(), a + b)
    out2 = torch.empty(12, device="tpu")[::2]
    torch.mul(a.to("tpu")[0, :], 2, out=out2[:4])
    torch.testing.assert_close(out2[:4].cpu(), a[0] * 2)


def test_zero_dim_and_empty_tensors():
    assert_matches_cpu(lambda a: a * 3 + 1, torch.tensor(2.5))
    assert_matches_cpu(lambda a: a.sum(), torch.randn(0, 3))
    assert_matches_cpu(lambda a: torch.cat([a, a]), torch.randn(0, 3))
    t = torch.tensor(4.0, device="tpu")
    assert float(t) == 4.0 and int(t) == 4 and bool(t)


def test_control_flow_on_tensor_value():
    t = torch.tensor([1.0, -2.0], device="tpu")
    assert (t.sum() < 0).item()
    if t[0] > 0:
        t = t * 2
    assert t.tolist() == [2.0, -4.0]


def grads(fn, *args):
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*args)
    torch.manual_seed(0)
    weight = torch.randn(out.shape).to(out.device)
    (out * weight).sum().backward()
    return out, [a.grad for a in args if a.requires_grad]


GRAD_CASES = {
    "pointwise": (lambda a, b: (a * b).exp().tanh() + a / (b.abs() + 1), (3, 4), (3, 4)),
    "broadcast": (lambda a, b: a.sigmoid() * b - a.pow(2), (3, 4), (4,)),
    "matmul": (lambda a, b: F.gelu(a @ b), (3, 5), (5, 2)),
    "reduce": (lambda a, b: a.softmax(-1).log().mean(0) + b.max(0).values, (3, 4), (2, 4)),
    "views": (lambda a, b: a.t()[1:, ::2].reshape(-1) * b.flatten(), (4, 3), (2, 2)),
    "norms": (lambda a, b: F.layer_norm(a, (4,), b, None), (3, 4), (4,)),
    "index": (lambda a, b: a[torch.tensor([2, 0, 2], device=a.device)] * b, (3, 4), (4,)),
    "cat_stack": (lambda a, b: torch.cat([a, b.unsqueeze(0).expand(2, 4)]).cumsum(0), (3, 4), (4,)),
    "conv": (lambda a, b: F.conv2d(a, b, padding=1).relu(), (1, 2, 5, 5), (3, 2, 3, 3)),
    "pool": (lambda a, b: F.max_pool2d(a * b, 2) + F.avg_pool2d(a, 2), (1, 2, 4, 4), (1, 2, 4, 4)),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradients_match_cpu(case):
    fn, *shapes = GRAD_CASES[case]
    torch.manual_seed(1)
    args = [torch.randn(*s) for s in shapes]
    out_c, g_c = grads(fn, *args)
    out_t, g_t = grads(fn, *[a.to("tpu") for a in args])
    torch.testing.assert_close(out_t.cpu(), out_c.detach(), atol=1e-5, rtol=1e-4)
    assert len(g_c) == len(g_t)
    for gc, gt in zip(g_c, g_t):
        assert gt.device.type == "tpu"
        torch.testing.assert_close(gt.cpu(), gc, atol=1e-5, rtol=1e-4)


def test_gradcheck_double():
    x = torch.randn(3, 4, dtype=torch.float64, device="tpu", requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, device="tpu", requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: torch.tanh(x @ w).sum(1), (x, w), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizers_match_cpu(opt_name, foreach):
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(3)]
    grads_ = [[torch.randn(4, 3), torch.randn(3)] for _ in range(3)]
    kwargs = dict(lr=0.1, foreach=foreach)
    if opt_name == "SGD":
        kwargs.update(momentum=0.9, weight_decay=0.01)
    results = []
    for dev in ("cpu", "tpu"):
        ps = [p.clone().to(dev).requires_grad_() for p in params]
        opt = getattr(torch.optim, opt_name)(ps, **kwargs)
        for gs in grads_:
            for p, g in zip(ps, gs):
                p.grad = g.to(dev)
            opt.step()
        results.append([p.detach().cpu() for p in ps])
    for c, t in zip(*results):
        torch.testing.assert_close(t, c, atol=1e-5, rtol=1e-5)
