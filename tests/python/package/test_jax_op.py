"""torch_pjrt.jax_op: JAX kernels inside PyTorch models, against PyTorch on the CPU."""
import copy

import pytest
import torch
import torch.nn as nn

import torch_pjrt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

DEVICE = "tpu"
TOL = dict(atol=1e-5, rtol=1e-5)
EPS = 1e-6


@torch_pjrt.jax_op("pjrt_test::rms_norm")
def jax_rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def jax_rope_fn(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


jax_rope = torch_pjrt.jax_op("pjrt_test::rope", jax_rope_fn)


def torch_rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Model(nn.Module):
    """Linear -> RMSNorm -> rotary embedding over heads -> Linear; norm and rope swappable."""

    def __init__(self, rms_norm, rope, width=16, heads=2, seq=6):
        super().__init__()
        self.rms_norm, self.rope, self.heads = rms_norm, rope, heads
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.norm_weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        d = width // heads
        angles = torch.arange(seq).float()[:, None] / (100.0 ** (torch.arange(d).float()[None, :] / d))
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        b, t, c = x.shape
        h = self.rms_norm(self.inp(x), self.norm_weight)
        h = h.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        h = self.rope(h.contiguous(), self.cos, self.sin)
        return self.out(h.transpose(1, 2).reshape(b, t, c))


def _models():
    torch.manual_seed(0)
    cpu = Model(torch_rms_norm, torch_rope)
    dev = Model(jax_rms_norm, jax_rope)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to(DEVICE)


def _forward_backward(model, x, compiled=False):
    fn = torch.compile(model, backend="tpu") if compiled else model
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.square().mean().backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("how", ["strict", "fused", "compiled"])
def test_jax_rmsnorm_and_rope_match_pytorch(how):
    cpu, dev = _models()
    x = torch.randn(2, 6, 16)
    expected = _forward_backward(cpu, x)
    mode = "fused" if how == "compiled" else how
    torch._dynamo.reset()
    with torch_pjrt.mode(mode):
        actual = _forward_backward(dev, x.to(DEVICE), compiled=how == "compiled")
        torch.testing.assert_close(actual[0].detach().cpu(), expected[0].detach(), **TOL)
        torch.testing.assert_close(actual[1].cpu(), expected[1], **TOL)
        for name, g in expected[2].items():
            torch.testing.assert_close(actual[2][name].cpu(), g, **TOL, msg=lambda m: f"{name}: {m}")
    assert "torch_pjrt::jax_call" not in torch_pjrt.metrics()["cpu_fallbacks"]


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_jax_kernel_is_inlined_into_one_fused_program():
    cpu, dev = _models()
    x = torch.randn(2, 6, 16)
    with torch_pjrt.mode("fused"), torch.no_grad():
        dev(x.to(DEVICE))  # compiles
        torch_pjrt.sync()
        torch.tpu.synchronize()
        before = torch_pjrt.metrics()["executions"]
        out = dev(x.to(DEVICE))  # linear, two jax kernels, linear: one program
        after = torch_pjrt.metrics()["executions"]
    assert after - before == 1
    torch.testing.assert_close(out.cpu(), cpu(x), **TOL)


def test_jax_op_on_cpu_tensors_runs_jax():
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(jax_rms_norm(x, w), torch_rms_norm(x, w), **TOL)


def test_multiple_outputs_and_decorator():
    @torch_pjrt.jax_op("pjrt_test::sincos")
    def sincos(x):
        return jnp.sin(x), jnp.cos(x) * 2

    x = torch.randn(5, 3)
    s, c = sincos(x.to(DEVICE))
    torch.testing.assert_close(s.cpu(), x.sin(), **TOL)
    torch.testing.assert_close(c.cpu(), x.cos() * 2, **TOL)


def test_unused_argument_and_linear_backward():
    """jit drops unused parameters from its module, but jax_call passes every argument: an unused input, and the
    backward of a linear function (whose vjp does not read the primals), must still compile."""
    op = torch_pjrt.jax_op("pjrt_test::linear_pair", lambda x, y, unused: (x * 2 + y, x - y))
    x, y, z = torch.randn(4, 3), torch.randn(4, 3), torch.randn(2)
    xd = x.to(DEVICE).requires_grad_()
    a, b = op(xd, y.to(DEVICE), z.to(DEVICE))
    torch.testing.assert_close(a.detach().cpu(), x * 2 + y, **TOL)
    (a.sum() + 2 * b.sum()).backward()
    torch.testing.assert_close(xd.grad.cpu(), torch.full((4, 3), 4.0), **TOL)


def test_bfloat16_on_cpu_tensors():
    """NumPy has no bfloat16: the CPU path goes through JAX's ml_dtypes bfloat16, both ways."""
    op = torch_pjrt.jax_op("pjrt_test::bf16_scale", lambda x: (x * 3).astype(jnp.bfloat16))
    x = torch.randn(5).to(torch.bfloat16)
    for device in ("cpu", DEVICE):
        out = op(x.to(device))
        assert out.dtype == torch.bfloat16 and out.device.type == device
        torch.testing.assert_close(out.cpu(), x * 3, atol=0, rtol=0)


def test_int64_argument_without_x64_is_refused():
    @torch_pjrt.jax_op("pjrt_test::plus_one")
    def plus_one(x):
        return x + 1

    with pytest.raises(TypeError, match="jax_enable_x64"):
        plus_one(torch.arange(4, device=DEVICE))


def _pallas():
    try:
        from jax.experimental import pallas as pl
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no Pallas in this jax: {e}")
    return pl


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_pallas_tiled_matmul_interpret_mode():
    pl = _pallas()
    block = 8

    def kernel(a_ref, b_ref, o_ref):
        # HIGHEST: JAX's default float32 dot on a GPU is TF32, not what a@b on the CPU computes
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)

    def matmul(a, b):
        m, n = a.shape[0], b.shape[1]
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
            grid=(m // block, n // block),
            in_specs=[pl.BlockSpec((block, a.shape[1]), lambda i, j: (i, 0)),
                      pl.BlockSpec((b.shape[0], block), lambda i, j: (0, j))],
            out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)),
            interpret=True,
        )(a, b)

    pallas_matmul = torch_pjrt.jax_op("pjrt_test::pallas_matmul", matmul)
    a, b = torch.randn(16, 12), torch.randn(12, 24)
    with torch.no_grad():
        for mode in ("strict", "fused"):
            with torch_pjrt.mode(mode):
                out = pallas_matmul(a.to(DEVICE), b.to(DEVICE)) + 1
                torch.testing.assert_close(out.cpu(), a @ b + 1, atol=1e-4, rtol=1e-4)
