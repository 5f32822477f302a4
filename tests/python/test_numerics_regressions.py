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
