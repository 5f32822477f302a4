"""Pallas kernels (interpret mode) inside a PyTorch model through torch_pjrt.jax_op.

A tiled matmul (grid over M, N and K, accumulating into the output block) and
a row softmax, each with a Pallas backward kernel (jax.custom_vjp: Pallas has
no reverse-mode autodiff of its own), are used in a small model; forward and
gradients must match the same model written in PyTorch on the CPU, in strict,
fused and compiled (torch.compile(backend="tpu")) mode. Also: JAX functions
that contain custom calls the plugin cannot run go to the CPU in every mode.
"""
import pytest
import torch
import torch.nn as nn

import torch_pjrt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
try:
    from jax.experimental import pallas as pl
except Exception as e:  # pragma: no cover - depends on the jax build
    pytest.skip(f"no Pallas in this jax: {e}", allow_module_level=True)

DEVICE = "tpu"
TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK = 8


# ---- kernels ----------------------------------------------------------------
def _matmul_kernel(a_ref, b_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def _pallas_matmul(a, b):
    (m, k), n = a.shape, b.shape[1]
    return pl.pallas_call(
        _matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // BLOCK, n // BLOCK, k // BLOCK),
        in_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda i, j, s: (i, s)),
                  pl.BlockSpec((BLOCK, BLOCK), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((BLOCK, BLOCK), lambda i, j, s: (i, j)),
        interpret=True,
    )(a, b)


@jax.custom_vjp
def matmul(a, b):
    return _pallas_matmul(a, b)


matmul.defvjp(lambda a, b: (_pallas_matmul(a, b), (a, b)),
              lambda res, g: (_pallas_matmul(g, res[1].T), _pallas_matmul(res[0].T, g)))


def _softmax_kernel(x_ref, o_ref):
    x = x_ref[...]
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_backward_kernel(y_ref, dy_ref, dx_ref):
    y, dy = y_ref[...], dy_ref[...]
    dx_ref[...] = y * (dy - jnp.sum(dy * y, axis=-1, keepdims=True))


def _rows(kernel, x, n_inputs):
    """pallas_call over blocks of BLOCK rows (the last block may be partial)."""
    spec = pl.BlockSpec((BLOCK, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], BLOCK),), in_specs=[spec] * n_inputs, out_specs=spec,
                          interpret=True)


@jax.custom_vjp
def _softmax_2d(x):
    return _rows(_softmax_kernel, x, 1)(x)


def _softmax_forward(x):
    y = _softmax_2d(x)
    return y, y


_softmax_2d.defvjp(_softmax_forward, lambda y, dy: (_rows(_softmax_backward_kernel, y, 2)(y, dy),))


def softmax(x):
    return _softmax_2d(x.reshape(-1, x.shape[-1])).reshape(x.shape)


pallas_matmul = torch_pjrt.jax_op("pallas_test::matmul", matmul)
pallas_softmax = torch_pjrt.jax_op("pallas_test::softmax", softmax)


# ---- the model --------------------------------------------------------------
class Model(nn.Module):
    """Linear -> matmul by a weight -> softmax -> Linear, with swappable matmul and softmax."""

    def __init__(self, matmul_fn, softmax_fn, width=16, hidden=32):
        super().__init__()
        self.matmul_fn, self.softmax_fn = matmul_fn, softmax_fn
        self.inp = nn.Linear(width, width)
        self.weight = nn.Parameter(torch.randn(width, hidden) / width ** 0.5)
        self.out = nn.Linear(hidden, width)

    def forward(self, x):
        b, t, c = x.shape
        h = self.matmul_fn(self.inp(x).reshape(b * t, c), self.weight)
        return self.out(self.softmax_fn(h.reshape(b, t, -1) * 3.0))


def _models():
    torch.manual_seed(0)
    cpu = Model(torch.matmul, lambda x: torch.softmax(x, -1))
    dev = Model(pallas_matmul, pallas_softmax)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev.to(DEVICE)


def _loss_and_grads(model, x, compiled=False):
    fn = torch.compile(model, backend="tpu") if compiled else model
    x = x.clone().requires_grad_(True)
    out = fn(x)
    (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).square().mean().backward()
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("how", ["strict", "fused", "compiled"])
def test_pallas_kernels_in_a_model_match_pytorch(how):
    cpu, dev = _models()
    x = torch.randn(2, 12, 16)  # 24 rows: three matmul row blocks, three softmax blocks
    expected = _loss_and_grads(cpu, x)
    torch._dynamo.reset()
    before = torch_pjrt.metrics()["cpu_fallbacks"].get("torch_pjrt::jax_call", 0)
    with torch_pjrt.mode("fused" if how == "compiled" else how):
        for _ in range(2):  # the second compiled call replays
            for p in dev.parameters():
                p.grad = None
            replays = torch_pjrt.metrics()["compiled_replays"]
            actual = _loss_and_grads(dev, x.to(DEVICE), compiled=how == "compiled")
        if how == "compiled":  # forward and backward programs, each with its Pallas kernels, replayed
            assert torch_pjrt.metrics()["compiled_replays"] - replays == 2, torch_pjrt._C._replay_refusal()
        torch.testing.assert_close(actual[0].detach().cpu(), expected[0].detach(), **TOL)
        torch.testing.assert_close(actual[1].cpu(), expected[1], **TOL)
        for name, g in expected[2].items():
            torch.testing.assert_close(actual[2][name].cpu(), g, **TOL, msg=lambda m: f"{name}: {m}")
    assert torch_pjrt.metrics()["cpu_fallbacks"].get("torch_pjrt::jax_call", 0) == before


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_pallas_softmax_partial_last_block():
    x = torch.randn(3, 5, 16)  # 15 rows: the last block of 8 is partial
    with torch_pjrt.mode("fused"):
        out = pallas_softmax(x.to(DEVICE))
    torch.testing.assert_close(out.cpu(), torch.softmax(x, -1), **TOL)


def test_pallas_without_custom_vjp_names_the_op_in_backward_error():
    plain = torch_pjrt.jax_op("pallas_test::plain_matmul", _pallas_matmul)
    a = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    out = plain(a, torch.randn(8, 8, device=DEVICE))
    with pytest.raises(Exception, match=r"pallas_test::plain_matmul.*custom_vjp"):
        out.sum().backward()


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("kind", ["lapack", "callback"])
def test_custom_calls_the_plugin_lacks_run_on_the_cpu(mode, kind):
    """A JAX function whose lowering has custom calls the CPU plugin cannot run (LAPACK, Python
    callbacks) runs with jax on the CPU in every mode, counted as a fallback, never an error."""
    import numpy as np

    fns = {"lapack": lambda x: jnp.linalg.inv(x) * 2,
           "callback": lambda x: jax.pure_callback(lambda a: np.asarray(a) * 2,
                                                   jax.ShapeDtypeStruct(x.shape, x.dtype), x) + x}
    op = torch_pjrt.jax_op(f"pallas_test::custom_call_{kind}_{mode}", fns[kind])
    x = torch.randn(4, 4) + 4 * torch.eye(4)
    expected = torch.linalg.inv(x) * 2 if kind == "lapack" else x * 3
    torch_pjrt.reset_metrics()
    try:
        with torch_pjrt.mode(mode):
            out = (op(x.to(DEVICE)) + 1).cpu()
        torch.testing.assert_close(out, expected + 1, **TOL)
        assert torch_pjrt.metrics()["cpu_fallbacks"].get("torch_pjrt::jax_call") == 1
    finally:
        torch_pjrt.reset_metrics()  # other files check that jax_call never fell back
