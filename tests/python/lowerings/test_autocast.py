"""torch.autocast("tpu") and torch.amp.GradScaler("tpu") against the CPU.

The cast policy is CUDA's (ATen's autocast op lists): the reference for one op
is that op on the CPU without autocast, its inputs cast as the policy
prescribes. Training loops compare with CPU autocast; GradScaler with the CPU's
GradScaler.
"""
import pytest
import torch
import torch.nn.functional as F

import torch_pjrt
from conftest import to_cpu, to_dev

LOW = [torch.bfloat16, torch.float16]


def tol(dtype):
    return {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}.get(
        dtype, dict(atol=1e-5, rtol=1e-5))


def cast_floats(args, dtype):
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def widest(args):
    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    out = floats[0]
    for d in floats[1:]:
        out = torch.promote_types(out, d)
    return out


def r(*shape):
    return torch.randn(*shape)


# (name, fn, args) per policy; args are CPU float32 tensors unless stated.
LOWER = [
    ("mm", torch.mm, lambda: [r(6, 5), r(5, 4)]),
    ("matmul", torch.matmul, lambda: [r(2, 6, 5), r(5, 4)]),
    ("bmm", torch.bmm, lambda: [r(2, 6, 5), r(2, 5, 4)]),
    ("addmm", torch.addmm, lambda: [r(6, 4), r(6, 5), r(5, 4)]),
    ("baddbmm", torch.baddbmm, lambda: [r(2, 6, 4), r(2, 6, 5), r(2, 5, 4)]),
    ("linear", F.linear, lambda: [r(3, 5), r(4, 5), r(4)]),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), lambda: [r(2, 3, 6, 6), r(4, 3, 3, 3), r(4)]),
    ("conv1d", F.conv1d, lambda: [r(2, 3, 8), r(4, 3, 3), r(4)]),
    ("mv", torch.mv, lambda: [r(6, 5), r(5)]),
    ("prelu", F.prelu, lambda: [r(2, 3, 4), torch.rand(3)]),
    ("conv_transpose2d", lambda x, w: F.conv_transpose2d(x, w, stride=2), lambda: [r(2, 3, 5, 5), r(3, 4, 3, 3)]),
    ("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), lambda: [r(2, 6, 5), r(2, 5, 4)]),
    ("addbmm", torch.addbmm, lambda: [r(6, 4), r(2, 6, 5), r(2, 5, 4)]),
    ("addr", torch.addr, lambda: [r(6, 4), r(6), r(4)]),
    ("sdpa", F.scaled_dot_product_attention, lambda: [r(2, 2, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)]),
]
FP32 = [
    ("exp", torch.exp, lambda: [r(5, 4)]),
    ("log", torch.log, lambda: [torch.rand(5, 4) + 0.1]),
    ("rsqrt", torch.rsqrt, lambda: [torch.rand(5, 4) + 0.1]),
    ("pow", torch.pow, lambda: [torch.rand(5, 4) + 0.1, 2.5]),
    ("softmax", lambda x: torch.softmax(x, -1), lambda: [r(5, 4)]),
    ("log_softmax", lambda x: torch.log_softmax(x, -1), lambda: [r(5, 4)]),
    ("sum", torch.sum, lambda: [r(5, 4)]),
    ("cumsum", lambda x: torch.cumsum(x, 0), lambda: [r(5, 4)]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), lambda: [r(5, 4), r(4), r(4)]),
    ("mse_loss", F.mse_loss, lambda: [r(5, 4), r(5, 4)]),
    ("norm", lambda x: torch.norm(x), lambda: [r(5, 4)]),
]
PROMOTE = [
    ("addcmul", torch.addcmul, lambda: [r(5, 4), r(5, 4), r(5, 4)]),
    ("atan2", torch.atan2, lambda: [r(5, 4), r(5, 4)]),
    ("cross", lambda a, b: torch.cross(a, b, dim=1), lambda: [r(5, 3), r(5, 3)]),
]


def run_tpu(fn, args, dtype):
    with torch.autocast("tpu", dtype=dtype):
        return fn(*to_dev(args))


def check_same(actual, expected, dtype):
    assert actual.device.type == "tpu"
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(to_cpu(actual), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name,fn,make", LOWER, ids=[c[0] for c in LOWER])
def test_lower_precision_ops(name, fn, make, dtype):
    torch.manual_seed(0)
    args = make()
    expected = fn(*cast_floats(args, dtype))  # CPU, inputs cast to the autocast dtype
    check_same(run_tpu(fn, args, dtype), expected, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name,fn,make", FP32, ids=[c[0] for c in FP32])
def test_fp32_ops(name, fn, make, dtype):
    torch.manual_seed(0)
    args = cast_floats(make(), dtype)  # low precision inputs come out float32
    expected = fn(*cast_floats(args, torch.float32))
    check_same(run_tpu(fn, args, dtype), expected, torch.float32)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name,fn,make", PROMOTE, ids=[c[0] for c in PROMOTE])
def test_promote_ops(name, fn, make, dtype):
    torch.manual_seed(0)
    args = make()
    args[0] = args[0].to(dtype)  # mixed inputs run in the widest dtype
    expected = fn(*cast_floats(args, widest(args)))
    check_same(run_tpu(fn, args, dtype), expected, widest(args))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_other_ops_keep_their_dtypes(dtype):
    x, y = r(5, 4), r(5, 4).to(torch.float64)
    with torch.autocast("tpu", dtype=dtype):
        out = F.relu(x.to("tpu")) + y.to("tpu")
        low = x.to("tpu").to(dtype) * 2
    assert out.dtype == torch.float64 and low.dtype == dtype
    torch.testing.assert_close(out.cpu(), F.relu(x) + y)
    torch.testing.assert_close(low.cpu(), x.to(dtype) * 2)


def test_autocast_result_matches_cpu_autocast_for_matmul():
    a, b = r(16, 32), r(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = a @ b
    with torch.autocast("tpu", dtype=torch.bfloat16):
        actual = a.to("tpu") @ b.to("tpu")
    check_same(actual, expected, torch.bfloat16)


def test_disabled_and_nested_autocast():
    a, b = r(6, 5), r(5, 4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        with torch.autocast("tpu", enabled=False):
            assert (a.to("tpu") @ b.to("tpu")).dtype == torch.float32
        assert (a.to("tpu") @ b.to("tpu")).dtype == torch.bfloat16
    assert (a.to("tpu") @ b.to("tpu")).dtype == torch.float32


def test_cpu_tensors_inside_tpu_autocast_are_not_cast():
    a, b = r(6, 5), r(5, 4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.float32


def test_binary_cross_entropy_is_banned_as_on_cuda():
    p, t = torch.rand(4).to("tpu"), torch.rand(4).to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, t)
        F.binary_cross_entropy_with_logits(p, t)  # the safe form runs


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_products_accumulate_in_f32(dtype):
    # Long sums of low-precision products: rounding each partial sum to bf16/f16 would drift.
    torch.manual_seed(0)
    a, b = torch.rand(4, 4096).to(dtype), torch.rand(4096, 4).to(dtype)
    exact = (a.double() @ b.double()).to(dtype)
    torch.testing.assert_close((a.to("tpu") @ b.to("tpu")).cpu(), exact, atol=0, rtol=1e-2)
    torch.testing.assert_close((a.to("tpu") @ b.to("tpu")).cpu(), a @ b, **tol(dtype))
    x, w = torch.rand(1, 512, 4, 4).to(dtype), torch.rand(2, 512, 3, 3).to(dtype)
    exact = F.conv2d(x.double(), w.double()).to(dtype)
    torch.testing.assert_close(F.conv2d(x.to("tpu"), w.to("tpu")).cpu(), exact, atol=0, rtol=1e-2)


def test_device_module_reports_amp_support():
    assert torch.tpu.is_bf16_supported()
    assert set(torch.tpu.get_amp_supported_dtype()) == {torch.bfloat16, torch.float16}
    for dtype in torch.tpu.get_amp_supported_dtype():
        with torch.autocast("tpu", dtype=dtype):
            assert torch.is_autocast_enabled("tpu")
            assert torch.get_autocast_dtype("tpu") == dtype
            assert (r(2, 3).to("tpu") @ r(3, 2).to("tpu")).dtype == dtype


def test_unsupported_autocast_dtype_warns_and_disables_as_on_cuda():
    with pytest.warns(UserWarning, match="not supported"):
        with torch.autocast("tpu", dtype=torch.float64):
            assert (r(2, 3).to("tpu") @ r(3, 2).to("tpu")).dtype == torch.float32


# ---- training under autocast ----

class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.GELU(), torch.nn.Linear(32, d))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(self.ln(h))
        return self.head(h)


def train(device, steps=4):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    # SGD, not Adam: Adam would blow up bf16 rounding noise in gradients that are
    # zero in exact arithmetic (the key projection's bias).
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 8), generator=g)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens.to(device))
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.to(device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_transformer_training_matches_cpu_autocast():
    torch_pjrt.reset_metrics()
    cpu_losses, cpu_state = train("cpu")
    tpu_losses, tpu_state = train("tpu")
    torch.testing.assert_close(tpu_losses, cpu_losses, atol=3e-2, rtol=3e-2)
    for k in cpu_state:
        torch.testing.assert_close(tpu_state[k], cpu_state[k], atol=3e-2, rtol=3e-2, msg=k)
    assert tpu_losses[-1] < tpu_losses[0]


# ---- GradScaler ----

def scaled_steps(device, dtype, inf_steps, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    g = torch.Generator().manual_seed(2)
    history = []
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        if step in inf_steps:
            x[3, 1] = float("inf") if step % 2 else float("nan")
        with torch.autocast(device, dtype=dtype):
            loss = model(x.to(device)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        history.append((scaler.get_scale(), [p.detach().cpu().clone() for p in model.parameters()]))
    return history


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_grad_scaler_skips_inf_steps_like_cpu(dtype):
    torch_pjrt.reset_metrics()
    inf_steps = {1, 4}
    cpu = scaled_steps("cpu", dtype, inf_steps)
    tpu = scaled_steps("tpu", dtype, inf_steps)
    fallbacks = torch_pjrt.metrics()["cpu_fallbacks"]
    assert not any("amp" in op for op in fallbacks), fallbacks
    assert [s for s, _ in tpu] == [s for s, _ in cpu]
    for step, ((_, tp), (_, cp)) in enumerate(zip(tpu, cpu)):
        for a, b in zip(tp, cp):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"step {step}")
        if step in inf_steps:  # skipped: exactly the previous step's parameters
            prev = tpu[step - 1][1]
            assert all(torch.equal(a, b) for a, b in zip(tp, prev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")], ids=str)
@pytest.mark.parametrize("inv_scale", [0.25, 1.0])
def test_unscale_op_matches_cpu(dtype, bad, inv_scale):
    torch_pjrt.reset_metrics()
    grads = [torch.randn(5, 3).to(dtype), torch.randn(7).to(dtype), torch.randn(()).to(dtype)]
    if bad is not None:
        grads[1][2] = bad
    found, inv = torch.zeros(1), torch.full((1,), inv_scale)
    tpu_grads, tpu_found = [t.to("tpu") for t in grads], found.to("tpu")
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(tpu_grads, tpu_found, inv.to("tpu"))
    torch.testing.assert_close(tpu_found.cpu(), found)
    for a, b in zip(tpu_grads, grads):
        torch.testing.assert_close(a.cpu(), b, atol=0, rtol=0, equal_nan=True)
    assert torch_pjrt.metrics()["cpu_fallbacks"] == {}


def test_unscale_keeps_a_found_inf_already_set():
    found = torch.ones(1).to("tpu")
    g = torch.ones(3).to("tpu")
    torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.full((1,), 0.5).to("tpu"))
    assert found.item() == 1.0 and g.cpu().tolist() == [0.5] * 3


def test_unscale_rejects_bad_arguments_like_cpu():
    g = [torch.ones(3).to("tpu")]
    with pytest.raises(RuntimeError, match="found_inf must be a float tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(g, torch.zeros(1, dtype=torch.float64).to("tpu"),
                                                         torch.ones(1).to("tpu"))
    with pytest.raises(RuntimeError, match="inv_scale must be a 1-element tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(g, torch.zeros(1).to("tpu"), torch.ones(2).to("tpu"))


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
@pytest.mark.parametrize("tracker", [0, 2, 3])
@pytest.mark.parametrize("scale,growth,backoff", [(1024.0, 2.0, 0.5), (3.0e38, 2.0, 0.5), (7.0, 1.1, 0.3)])
def test_update_scale_op_matches_cpu(found_inf, tracker, scale, growth, backoff):
    torch_pjrt.reset_metrics()
    s, t, f = torch.tensor([scale]), torch.tensor([tracker], dtype=torch.int32), torch.tensor([found_inf])
    ts, tt = s.to("tpu"), t.to("tpu")
    torch._amp_update_scale_(s, t, f, growth, backoff, 3)
    out = torch._amp_update_scale_(ts, tt, f.to("tpu"), growth, backoff, 3)
    assert out is ts
    assert torch.equal(ts.cpu(), s) and torch.equal(tt.cpu(), t)
    assert torch_pjrt.metrics()["cpu_fallbacks"] == {}


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_update_scale_functional_and_out_forms_match_cpu(found_inf):
    torch_pjrt.reset_metrics()

    def run(device):
        s, t = torch.tensor([8.0], device=device), torch.tensor([2], dtype=torch.int32, device=device)
        f = torch.tensor([found_inf], device=device)
        new_s, new_t = torch.ops.aten._amp_update_scale(s, t, f, 2.0, 0.5, 3)
        out = torch.empty(1, device=device)
        torch.ops.aten._amp_update_scale.out(s, t, f, 2.0, 0.5, 3, out=out)
        return [x.cpu() for x in (new_s, new_t, s, t, out)]

    for a, b in zip(run("tpu"), run("cpu")):
        assert torch.equal(a, b)
    assert torch_pjrt.metrics()["cpu_fallbacks"] == {}
