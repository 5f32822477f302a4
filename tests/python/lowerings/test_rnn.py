"""Recurrent layers (ATen calls the fused LSTM/GRU cell kernels on this
device) and bicubic interpolation: forward and gradients against CPU PyTorch,
in fused and strict mode, without CPU fallbacks."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

MODES = ["fused", "strict"]
TOL = dict(atol=1e-4, rtol=1e-4)


def fallbacks():
    return sum(torch_pjrt.metrics()["cpu_fallbacks"].values())


def outputs_and_grads(module, inputs):
    """Forward, a backward through every output, and the gradients of inputs and parameters."""
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = module(*inputs)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    # Weights per element, so each gradient path is exercised distinctly.
    loss = sum((t * torch.linspace(-1, 1, t.numel(), device=t.device).reshape(t.shape)).sum() for t in leaves)
    loss.backward()
    grads = [x.grad for x in inputs if x.requires_grad] + [p.grad for p in module.parameters()]
    return [t.detach().cpu() for t in leaves + grads]


def check_module(mode, module, *inputs, **tol):
    torch.manual_seed(0)
    expected = outputs_and_grads(copy.deepcopy(module), inputs)
    with torch_pjrt.mode(mode):
        before = fallbacks()
        actual = outputs_and_grads(copy.deepcopy(module).to("tpu"), [x.to("tpu") for x in inputs])
        assert fallbacks() == before, torch_pjrt.metrics()["cpu_fallbacks"]
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, **(tol or TOL))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell(mode, bias):
    torch.manual_seed(1)
    cell = nn.LSTMCell(5, 4, bias=bias)
    x, h, c = torch.randn(3, 5), torch.randn(3, 4), torch.randn(3, 4)
    check_module(mode, LSTMCellStep(cell), x, h, c)
    check_module(mode, cell, x)  # zero initial state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell(mode, bias):
    torch.manual_seed(2)
    cell = nn.GRUCell(5, 4, bias=bias)
    x, h = torch.randn(3, 5), torch.randn(3, 4)
    check_module(mode, cell, x, h)
    check_module(mode, cell, x)


class LSTMCellStep(nn.Module):
    """An LSTMCell called as cell(x, (h, c)), unrolled over two steps."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x, h, c):
        h1, c1 = self.cell(x, (h, c))
        return self.cell(x * 0.5, (h1, c1))


@pytest.mark.parametrize("mode", MODES)
def test_lstm_two_layers_bidirectional_batch_first(mode):
    torch.manual_seed(3)
    lstm = nn.LSTM(6, 5, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(3, 7, 6)
    h0, c0 = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    check_module(mode, WithState(lstm, lstm_state=True), x, h0, c0)
    check_module(mode, lstm, x)


@pytest.mark.parametrize("mode", MODES)
def test_lstm_sequence_first(mode):
    torch.manual_seed(4)
    lstm = nn.LSTM(4, 6, num_layers=1)
    check_module(mode, lstm, torch.randn(5, 2, 4))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_gru(mode, bidirectional):
    torch.manual_seed(5)
    gru = nn.GRU(6, 5, num_layers=2, bidirectional=bidirectional, batch_first=True)
    x = torch.randn(3, 7, 6)
    h0 = torch.randn(4 if bidirectional else 2, 3, 5)
    check_module(mode, WithState(gru, lstm_state=False), x, h0)
    check_module(mode, gru, x)


class WithState(nn.Module):
    def __init__(self, rnn, lstm_state):
        super().__init__()
        self.rnn, self.lstm_state = rnn, lstm_state

    def forward(self, x, h, c=None):
        return self.rnn(x, (h, c)) if self.lstm_state else self.rnn(x, h)


@pytest.mark.parametrize("mode", MODES)
def test_lstm_trains_like_cpu(mode):
    """A few SGD steps: the same losses as on the CPU."""
    def train(device):
        torch.manual_seed(6)
        lstm, head = nn.LSTM(3, 8, batch_first=True), nn.Linear(8, 1)
        lstm, head = lstm.to(device), head.to(device)
        opt = torch.optim.SGD(list(lstm.parameters()) + list(head.parameters()), lr=0.1)
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(4, 5, 3, generator=g).to(device), torch.randn(4, 1, generator=g).to(device)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            out, _ = lstm(x)
            loss = F.mse_loss(head(out[:, -1]), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    expected = train("cpu")
    with torch_pjrt.mode(mode):
        actual = train("tpu")
    torch.testing.assert_close(actual, expected, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_fused_cell_ops_directly(mode):
    """The aten ops themselves, including their backward kernels without bias."""
    torch.manual_seed(8)
    ig, hg, cx = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 4)
    gi, gh, hx = torch.randn(3, 12), torch.randn(3, 12), torch.randn(3, 4)
    grad = torch.randn(3, 4)
    aten = torch.ops.aten

    def run(d):
        t = lambda x: x.to(d)
        hy, cy, ws = aten._thnn_fused_lstm_cell(t(ig), t(hg), t(cx))
        back = aten._thnn_fused_lstm_cell_backward_impl(t(grad), None, t(cx), cy, ws, False)
        back_c = aten._thnn_fused_lstm_cell_backward_impl(None, t(grad), t(cx), cy, ws, True)
        gru_hy, gru_ws = aten._thnn_fused_gru_cell(t(gi), t(gh), t(hx))
        gru_back = aten._thnn_fused_gru_cell_backward(t(grad), gru_ws, False)
        out = [hy, cy, ws, back[0], back[1], *back_c, gru_hy, gru_ws, *gru_back[:3]]
        assert back[2] is None and gru_back[3] is None and gru_back[4] is None
        return [x.cpu() for x in out]

    # The CPU has no kernels for these: the reference is the module path's math,
    # checked above; here the CUDA-layout identities are checked instead.
    with torch_pjrt.mode(mode):
        out = run("tpu")
    hy, cy, ws = out[0], out[1], out[2]
    i, f, g, o = (ig + hg).chunk(4, 1)
    torch.testing.assert_close(cy, torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g), **TOL)
    torch.testing.assert_close(hy, torch.sigmoid(o) * torch.tanh(cy), **TOL)
    torch.testing.assert_close(ws, torch.cat([torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)], 1),
                               **TOL)
    # LSTM backward against autograd of the same math on the CPU.
    gates = (ig + hg).requires_grad_()
    c0 = cx.clone().requires_grad_()
    a, b, cc, d = gates.chunk(4, 1)
    c1 = torch.sigmoid(b) * c0 + torch.sigmoid(a) * torch.tanh(cc)
    (torch.sigmoid(d) * torch.tanh(c1) * grad).sum().backward()
    torch.testing.assert_close(out[3], gates.grad, **TOL)
    torch.testing.assert_close(out[4], c0.grad, **TOL)
    torch.testing.assert_close(out[7], out[5].sum(0), **TOL)  # grad_bias with has_bias
    # GRU against autograd of the same math on the CPU.
    gi_, gh_, h0 = gi.clone().requires_grad_(), gh.clone().requires_grad_(), hx.clone().requires_grad_()
    ir, ii, in_ = gi_.chunk(3, 1)
    hr, hi, hn = gh_.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(ii + hi)
    n = torch.tanh(in_ + r * hn)
    h1 = n + z * (h0 - n)
    torch.testing.assert_close(out[8], h1.detach(), **TOL)
    (h1 * grad).sum().backward()
    torch.testing.assert_close(out[10], gi_.grad, **TOL)
    torch.testing.assert_close(out[11], gh_.grad, **TOL)
    torch.testing.assert_close(out[12], h0.grad, **TOL)


# ---- bicubic interpolation (its decomposition uses bitwise_left_shift(int, Tensor)) ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size,scale", [((7, 9), None), ((3, 4), None), (None, 2.5)])
def test_bicubic_interpolate_forward_backward(mode, align_corners, size, scale):
    torch.manual_seed(9)
    x = torch.randn(2, 3, 5, 6)
    check_module(mode, Bicubic(size, scale, align_corners), x)


class Bicubic(nn.Module):
    def __init__(self, size, scale, align_corners):
        super().__init__()
        self.size, self.scale, self.align_corners = size, scale, align_corners

    def forward(self, x):
        return F.interpolate(x, size=self.size, scale_factor=self.scale, mode="bicubic",
                             align_corners=self.align_corners)


@pytest.mark.parametrize("mode", MODES)
def test_bitwise_shifts_with_a_scalar_first(mode):
    exponent = torch.tensor([0, 1, 3, 7])
    for fn in (lambda e: torch.bitwise_left_shift(1, e), lambda e: torch.bitwise_right_shift(256, e),
               lambda e: 1 << e, lambda e: 1024 >> e):
        expected = fn(exponent)
        with torch_pjrt.mode(mode):
            actual = fn(exponent.to("tpu")).cpu()
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
