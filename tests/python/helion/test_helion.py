"""Helion kernels on tpu tensors (python/torch_pjrt/helion/): their Pallas JAX view inside the tpu program.

An elementwise kernel with a scalar argument (gelu of x * alpha + y), a tiled matmul (tiles of M, N and K,
accumulated in float32) and a row softmax run between PyTorch ops on tpu, against the same computation in
PyTorch on the CPU: in strict and fused mode and under torch.compile(backend="tpu"), with no CPU fallback and
no transfer between host and device inside the calls, and in fused and compiled mode as one program.
The kernels name no backend (Helion's default is Triton): their tpu calls use Helion's Pallas backend.
"""
import warnings

import pytest
import torch

import torch_pjrt

helion = pytest.importorskip("helion")
pytest.importorskip("jax")
hl = pytest.importorskip("helion.language")

DEVICE = "tpu"
TOL = dict(atol=1e-4, rtol=1e-4)


@helion.kernel(autotune_effort="none")
def gelu_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = torch.nn.functional.gelu(x[tile] * alpha + y[tile])
    return out


@helion.kernel(config=helion.Config(block_sizes=[16, 16, 16]))
def matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    m, k = x.size()
    _, n = y.size()
    out = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m, tile_n in hl.tile([m, n]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            acc = torch.addmm(acc, x[tile_m, tile_k], y[tile_k, tile_n])
        out[tile_m, tile_n] = acc.to(out.dtype)
    return out


@helion.kernel(config=helion.Config(block_sizes=[8]))
def softmax(x: torch.Tensor) -> torch.Tensor:
    n, _ = x.size()
    out = torch.empty_like(x)
    for tile_n in hl.tile(n):
        out[tile_n, :] = torch.nn.functional.softmax(x[tile_n, :], dim=1)
    return out


@helion.kernel()  # no config: it would autotune
def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(out.size()):
        out[tile] = x[tile] + y[tile]
    return out


@helion.kernel(autotune_effort="none")
def add_into(x: torch.Tensor, y: torch.Tensor) -> None:
    for tile in hl.tile(x.size()):
        x[tile] = x[tile] + y[tile]


def model(x, y, w, alpha):
    h = gelu_add(x.sin(), y, alpha)
    return softmax(matmul(h, w) * 0.5) + 1


def reference(x, y, w, alpha):
    h = torch.nn.functional.gelu(x.sin() * alpha + y)
    return torch.softmax(h @ w * 0.5, dim=1) + 1


def _inputs():
    torch.manual_seed(0)
    return torch.randn(32, 48), torch.randn(32, 48), torch.randn(48, 40)  # 40 columns: a partial N tile


def _transfers(m):
    return m["host_to_device_bytes"] + m["device_to_host_bytes"]


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_kernels_between_torch_ops_match_cpu(mode):
    x, y, w = _inputs()
    dev = [t.to(DEVICE) for t in (x, y, w)]
    torch_pjrt.sync()
    with torch_pjrt.mode(mode):
        for alpha in (0.5, 2.0):  # a scalar argument is a constant: one op per value
            reference(*dev, alpha)  # strict mode uploads the PyTorch ops' scalars at their first use
            torch_pjrt.sync()
            torch_pjrt.reset_metrics()
            out = model(*dev, alpha)
            torch_pjrt.sync()
            m = torch_pjrt.metrics()
            assert out.device.type == DEVICE
            assert _transfers(m) == 0, m  # nothing went through the host
            assert not m["cpu_fallbacks"], m["cpu_fallbacks"]
            assert m["lowered_ops"].get("torch_pjrt::jax_call") == 3
            if mode == "fused":  # the kernels and the ops around them: one program
                assert m["executions"] == 1
            torch.testing.assert_close(out.cpu(), reference(x, y, w, alpha), **TOL)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_kernels_in_torch_compile_are_one_replayed_program():
    x, y, w = _inputs()
    dev = [t.to(DEVICE) for t in (x, y, w)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y, w: model(x, y, w, 0.5), backend="tpu", fullgraph=True)
    with torch_pjrt.mode("fused"):
        compiled(*dev)  # compiles
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        for _ in range(2):
            out = compiled(*dev)
        torch_pjrt.sync()
        m = torch_pjrt.metrics()
    assert m["compiled_replays"] == 2 and m["executions"] == 2, torch_pjrt._C._replay_refusal()
    assert _transfers(m) == 0 and not m["cpu_fallbacks"], m
    torch.testing.assert_close(out.cpu(), reference(x, y, w, 0.5), **TOL)


def test_cpu_calls_stay_helions_and_a_pallas_interpret_kernel_is_its_own_twin():
    from torch_pjrt import helion as tpu_helion

    @helion.kernel(backend="pallas", pallas_interpret=True, autotune_effort="none")
    def scale(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for tile in hl.tile(out.size()):
            out[tile] = x[tile] * 3.0
        return out

    x = torch.randn(16, 8)
    torch.testing.assert_close(scale(x), x * 3.0)  # Helion's own launcher on the CPU
    assert tpu_helion.tpu_kernel(scale).twin is scale
    assert tpu_helion.tpu_kernel(gelu_add).twin is not gelu_add  # a Triton (default) kernel gets a Pallas twin
    assert tpu_helion.tpu_kernel(gelu_add).twin.settings.backend == "pallas"
    torch.testing.assert_close(scale(x.to(DEVICE)).cpu(), x * 3.0)


def test_a_kernel_that_would_autotune_uses_a_default_config_and_says_so():
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.warns(UserWarning, match="autotuning cannot benchmark"):
        out = add(x.to(DEVICE), y.to(DEVICE))
    torch.testing.assert_close(out.cpu(), x + y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per kernel
        add(x.to(DEVICE), y.to(DEVICE))


def test_a_kernel_writing_its_argument_is_refused_on_tpu():
    x = torch.zeros(8, 8, device=DEVICE)
    with pytest.raises(NotImplementedError, match="writes its argument"):
        add_into(x, x)
