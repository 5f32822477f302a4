"""gradcheck on tpu: a forward per perturbed element (autograd on) and a backward per output element, with
nothing read in between. Fused mode used to cut such loops only at the op limit, at a different op each
time, so every graph was new (hundreds of seconds of compiles for a small float64 TransformerEncoder, and a
different program per repeated backward broke gradcheck's reentrancy check). Graphs are now cut at module
returns and backward ends once they are half the limit, so the loop reuses a few programs."""
import pytest
import torch
import torch.nn as nn

import torch_pjrt


def _encoder(device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch_pjrt.get_mode() == "lazy", reason="lazy mode runs graphs only at sync() or a read: "
                    "gradcheck's loop is a few huge graphs there (minutes of compiling); the cut under test is fused mode's")
def test_transformer_encoder_gradcheck_float64():
    enc_cpu = _encoder("cpu")
    enc = _encoder("tpu")
    x_cpu = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x_cpu.to("tpu").requires_grad_()
    before = torch_pjrt.metrics()
    assert torch.autograd.gradcheck(lambda t: enc(t), (x,))  # nondet_tol 0: repeated backwards agree exactly
    after = torch_pjrt.metrics()
    compiles = after["compiles"] - before["compiles"]
    graphs = after["graphs"] - before["graphs"]
    # this test's own fallbacks: the counter is process-wide and earlier tests' fallbacks stay in it
    fallbacks = {op: n - before["cpu_fallbacks"].get(op, 0) for op, n in after["cpu_fallbacks"].items()}
    assert not {op: n for op, n in fallbacks.items() if n}
    if torch_pjrt._C._get_mode() == "fused":
        # 48 perturbed elements x 2 forwards and 48 backwards: a handful of programs, reused
        assert compiles <= 16, (compiles, graphs, after.get("recompile_reasons"))
    # the gradients it checked are the CPU's
    x_cpu.requires_grad_()
    enc_cpu(x_cpu).square().sum().backward()
    enc(x).square().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.timeout(120)
def test_repeated_backward_without_reads_reuses_graphs():
    # jacobian rows by repeated autograd.grad, the rows stay on the device until the end
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x_cpu = torch.randn(16, 6, dtype=torch.float64, requires_grad=True)  # 96 rows: past the op limit
    lin_t = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double().to("tpu")
    lin_t.load_state_dict(lin.state_dict())
    x = x_cpu.detach().to("tpu").requires_grad_()

    def jac(f, x):
        y = f(x).reshape(-1)
        rows = torch.zeros(y.numel(), x.numel(), dtype=x.dtype, device=x.device)
        for i in range(y.numel()):
            g = torch.zeros_like(y)
            g[i] = 1
            (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
            rows[i].copy_(gx.reshape(-1))
        return rows

    before = torch_pjrt.metrics()["compiles"]
    got = jac(lin_t, x).cpu()
    compiles = torch_pjrt.metrics()["compiles"] - before
    torch.testing.assert_close(got, jac(lin, x_cpu), rtol=1e-12, atol=1e-12)
    if torch_pjrt._C._get_mode() == "fused":
        assert compiles <= 8, compiles
