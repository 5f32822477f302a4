"""TorchTPU's torch.tpu API on torch_pjrt (python/torch_pjrt/torchtpu/), against PyTorch on the CPU and NumPy.

docs/torchtpu-compat.md lists every TorchTPU 0.2.0 public name; a test here checks that the table and the
installed names agree (an "absent" name raises AttributeError with its reason, the others exist). The cases
that need a fresh runtime (two devices, dumped programs) or two ranks run in subprocesses.
"""
import os
import re
import socket
import subprocess
import sys
import textwrap
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_pjrt
from torch_pjrt import torchtpu
from torch_pjrt.torchtpu import pallas as pallas_impl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DOC = os.path.join(ROOT, "docs", "torchtpu-compat.md")
DEVICE = "tpu"
TOL = dict(atol=1e-5, rtol=1e-5)


def _subprocess_env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", **extra)
    return env


# ---- the table and the installed names ------------------------------------------------------------------

def _table():
    rows = {}
    with open(DOC) as f:
        for line in f:
            m = re.match(r"\|\s*`(torch\.tpu[\w.]*)`\s*\|\s*(ours, differs|ours|absent)\s*\|", line)
            if m:
                rows[m.group(1)] = m.group(2)
    return rows


def _lookup(qualified):
    module, _, name = qualified.rpartition(".")
    return getattr(sys.modules[module], name)


def test_table_lists_every_name_and_matches_what_is_installed():
    rows = _table()
    absent = {f"{module}.{name}" for module, names in torchtpu.ABSENT.items() for name in names}
    assert absent <= set(rows), sorted(absent - set(rows))
    # TorchTPU 0.2.0's public table (torch_tpu/_internal/public_api.py) has 71 names; custom_jax_kernel is
    # listed too (TorchTPU's blog post names it; 0.2.0 keeps it internal and deprecated).
    assert len(rows) == 72
    for name, status in rows.items():
        if status == "absent":
            assert name in absent, name
            with pytest.raises(AttributeError, match="not provided by torch_pjrt: .*torchtpu-compat.md"):
                _lookup(name)
        else:
            assert name not in absent, name
            assert _lookup(name) is not None, name


def test_submodules_import_as_torchtpu_code_imports_them():
    import torch.tpu.ops
    import torch.tpu.pallas
    from torch.tpu.distributed import spmd_safe
    from torch.tpu.ops import ragged_dot
    from torch.tpu.profiler import TpuProfilerConfig

    assert torch.tpu.pallas.jax_op is pallas_impl.jax_op and ragged_dot is torch.tpu.ops.ragged_dot
    assert callable(spmd_safe) and TpuProfilerConfig is not None
    assert sys.modules["torch.tpu.compiler"] is torch.tpu.compiler
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        torch.tpu.ops.no_such_name
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        torch.tpu.no_such_name


# ---- torch.tpu: eager modes, precision, devices, streams, RNG -------------------------------------------

@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_eager_modes_are_torch_pjrt_modes():
    EagerMode = torch.tpu.EagerMode
    assert {m.name: m.value for m in EagerMode} == {
        "DEFER_AND_FUSE": "fused", "DEFER_NEVER": "strict", "DEFER_NEVER_AND_LAUNCH_BLOCKING": "debug",
        "_LAZY": "lazy"}
    before = torch_pjrt.get_mode()
    try:
        torch.tpu.eager_mode = EagerMode.DEFER_NEVER
        assert torch_pjrt.get_mode() == "strict" and torch.tpu.eager_mode is EagerMode.DEFER_NEVER
        x = torch.randn(5, 7)
        # In fused mode the two ops run as one graph when read; in strict mode each op is a program of its own.
        for mode, graphs in ((EagerMode.DEFER_AND_FUSE, 1), (EagerMode.DEFER_NEVER, 0),
                             (EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING, 0)):
            with torch.tpu.set_eager_mode(mode):
                assert torch.tpu.eager_mode is mode and torch_pjrt.get_mode() == mode.value
                torch_pjrt.reset_metrics()
                y = (x.to(DEVICE).sin() * 3).cpu()
                assert torch_pjrt.metrics()["graphs"] == graphs, mode
                torch.testing.assert_close(y, x.sin() * 3, **TOL)
            assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER  # restored after the block
        with torch_pjrt.mode("lazy"):
            assert torch.tpu.eager_mode is EagerMode._LAZY
        with pytest.raises(ValueError, match="expected a torch.tpu.EagerMode"):
            torch.tpu.eager_mode = "eager"
        with pytest.raises(ValueError, match="expected a torch.tpu.EagerMode"):
            with torch.tpu.set_eager_mode(3):
                pass
    finally:
        torch_pjrt.set_mode(before)


def test_precision_sets_the_float32_matmul_precision_for_the_block():
    P = torch.tpu.Precision
    assert torch.get_float32_matmul_precision() == "highest"
    a, b = torch.randn(6, 5), torch.randn(5, 3)
    for mode, setting in ((P.DEFAULT, "medium"), (P.HIGH, "high"), (P.HIGHEST, "highest")):
        with torch.tpu.precision(mode):
            assert torch.get_float32_matmul_precision() == setting
            out = (a.to(DEVICE) @ b.to(DEVICE)).cpu()
        torch.testing.assert_close(out, a @ b, atol=2e-2, rtol=2e-2)
        assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(RuntimeError, match="boom"):
        with torch.tpu.precision(P.HIGH):
            raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="Precision.DEFAULT"):
        with torch.tpu.precision("high"):
            pass


FRESH_RUNTIME = textwrap.dedent(r"""
    import glob, os, torch, torch_pjrt
    dump = os.environ["TORCH_PJRT_DUMP_DIR"]

    def new_texts(fn):
        before = set(glob.glob(dump + "/*"))
        fn()
        return [open(p).read() for p in sorted(set(glob.glob(dump + "/*")) - before)]

    # device_of: the tensor's device for the block, then the previous one; a no-op for a CPU tensor.
    assert torch.tpu.device_count() == 2
    t1 = torch.ones(3, device="tpu:1")
    assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(t1):
        assert torch.tpu.current_device() == 1
        assert torch.ones(2, device="tpu").device == torch.device("tpu", 1)
    assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(torch.ones(2)):
        assert torch.tpu.current_device() == 0

    torch_pjrt.set_mode("strict")
    # precision(): the precision_config of the dot in the program
    a, b = torch.randn(16, 8), torch.randn(8, 4)
    for mode, want in ((torch.tpu.Precision.HIGH, "HIGH"), (torch.tpu.Precision.DEFAULT, "DEFAULT"),
                       (torch.tpu.Precision.HIGHEST, "HIGHEST")):
        with torch.tpu.precision(mode):
            texts = new_texts(lambda: (a.to("tpu") @ b.to("tpu")).cpu())
        got = sorted({t.split("precision ")[1].split(">")[0] for t in texts if "precision " in t})
        assert got == [want], (mode, got)

    # optimization_barrier: the program of the barrier op holds a stablehlo.optimization_barrier
    x = torch.randn(4, 5, device="tpu")
    y = torch.randn(4, 5, device="tpu")
    texts = new_texts(lambda: [t.cpu() for t in torch.tpu.ops.optimization_barrier([x, y])])
    assert sum(t.count("optimization_barrier") for t in texts) >= 1, texts
    print("FRESH_RUNTIME_OK")
""")


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_device_of_precision_and_barrier_in_a_fresh_runtime(tmp_path):
    env = _subprocess_env(TORCH_PJRT_DUMP_DIR=str(tmp_path), TORCH_PJRT_CPU_DEVICES="2")
    r = subprocess.run([sys.executable, "-c", FRESH_RUNTIME], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0 and "FRESH_RUNTIME_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_set_stream_takes_tpu_streams_only():
    stream = torch.tpu.current_stream()
    torch.tpu.set_stream(stream)
    assert torch.tpu.current_stream() == stream == torch.tpu.default_stream()
    x = torch.randn(3)
    side = torch.tpu.Stream()
    with torch.tpu.stream(side):
        assert torch.tpu.current_stream() == side != torch.tpu.default_stream()
        y = (x.to(DEVICE) * 2).cpu()
    assert torch.tpu.current_stream() == stream
    torch.testing.assert_close(y, x * 2)
    with pytest.raises(ValueError, match="expected a tpu stream"):
        torch.tpu.set_stream(torch.Stream("cpu"))
    with pytest.raises(RuntimeError, match="invalid tpu device index"):
        torch.tpu.set_stream(types.SimpleNamespace(device=torch.device("tpu", torch.tpu.device_count())))


def test_default_generators_are_the_devices_own():
    gens = torch.tpu.default_generators
    assert len(gens) == torch.tpu.device_count() and gens is torch.tpu.default_generators
    assert all(isinstance(g, torch.Generator) and g.device == torch.device("tpu", i) for i, g in enumerate(gens))
    state = torch.tpu.get_rng_state()
    try:
        gens[0].manual_seed(123)
        first = torch.rand(5, device="tpu").cpu()
        torch.tpu.manual_seed(123)  # the same generator
        assert torch.equal(torch.rand(5, device="tpu").cpu(), first)
        assert gens[0].initial_seed() == 123
    finally:
        torch.tpu.set_rng_state(state)


def test_device_properties_and_rng_names():
    props = torch.tpu.get_device_properties()
    assert props.name == torch_pjrt._C._device_kind(0)
    assert torch.tpu.get_device_name() == f"{props.name} ({torch_pjrt.platform()['name']})"
    assert props.total_memory == torch.tpu.mem_get_info()[1] > 0 and props.multi_processor_count == 1
    torch.tpu.manual_seed(1234)
    assert torch.tpu.initial_seed() == 1234
    first = torch.rand(5, device=DEVICE).cpu()
    torch.tpu.manual_seed_all(1234)
    torch.testing.assert_close(torch.rand(5, device=DEVICE).cpu(), first, atol=0, rtol=0)
    state = torch.tpu.get_rng_state()
    again = torch.rand(3, device=DEVICE).cpu()
    torch.tpu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3, device=DEVICE).cpu(), again, atol=0, rtol=0)


def test_topology_aware_mesh_alias_warns_and_needs_a_process_group():
    from torch_pjrt.torchtpu import _device

    _device._warned_topology_alias = False
    with pytest.warns(FutureWarning, match="torch.tpu.distributed.topology_aware_mesh"):
        with pytest.raises(RuntimeError, match="init_process_group"):
            torch.tpu.topology_aware_mesh((1,))


# ---- torch.tpu.pallas -----------------------------------------------------------------------------------

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _scale_add(x: jax.Array, y: jax.Array, alpha: float, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    return (x * alpha + y).astype(dtype), x - y


scale_add = torch.tpu.pallas.jax_op("torchtpu_test::scale_add", _scale_add, donate_argnums=(1,))


def test_jax_op_constants_results_and_donation():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    xn, yn = x.numpy(), y.numpy()
    for device in (DEVICE, "cpu"):
        xd = x.to(device)
        for alpha, dtype in ((2.0, torch.float32), (-0.5, torch.bfloat16), (2.0, torch.bfloat16)):
            yd = y.to(device, copy=True)  # donated: y (and yn, its NumPy view) must stay
            out = scale_add(xd, yd, alpha, dtype)
            assert isinstance(out, tuple) and len(out) == 2
            assert out[0].dtype == dtype and out[0].device.type == device
            np.testing.assert_allclose(out[0].float().cpu().numpy(),
                                       torch.from_numpy(xn * alpha + yn).to(dtype).float().numpy(), rtol=1e-6)
            np.testing.assert_allclose(out[1].cpu().numpy(), xn - yn, rtol=1e-6)
            # the donated y holds the first result of its shape and dtype, and is returned as that result
            assert (out[0] if dtype == torch.float32 else out[1]) is yd
    # one torch op per set of constants, whichever device the tensors are on
    assert len(scale_add._ops) == 3


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("how", ["strict", "fused", "lazy", "debug", "compiled"])
def test_jax_op_donation_updates_the_tensor_in_its_own_buffer(how):
    """A donated tensor's buffer becomes the result's: the same device address, counted as donated, in one
    program in every mode (strict and debug too) and under torch.compile; values as on the CPU."""
    step = torch.tpu.pallas.jax_op(f"torchtpu_test::donating_{how}", lambda p, g, lr: (p - lr * g, (g * g).sum()),
                                   donate_argnums=(0,))

    def train(p, g):
        p, norm = step(p, g, 0.5)
        return norm * 2

    p, g = torch.randn(64, 32), torch.randn(64, 32)
    fn = torch.compile(train, backend="tpu") if how == "compiled" else train
    pd, gd = p.to(DEVICE), g.to(DEVICE)
    torch_pjrt.sync()
    address = torch_pjrt._C._storage_buffer_address(pd)
    torch._dynamo.reset()
    with torch_pjrt.mode("fused" if how == "compiled" else how):
        torch_pjrt.reset_metrics()
        norm = fn(pd, gd)
        torch_pjrt.sync()
        m = torch_pjrt.metrics()
    assert m["donated_buffers"] >= 1 and m["donated_bytes"] >= p.numel() * 4
    assert m["executions"] == (2 if how in ("strict", "debug") else 1)  # op by op: the jax op, then `* 2`
    assert not m["cpu_fallbacks"]
    assert torch_pjrt._C._storage_buffer_address(pd) == address  # updated in place: no new buffer, no copy
    torch.testing.assert_close(pd.cpu(), p - 0.5 * g, **TOL)
    torch.testing.assert_close(norm.cpu(), (g * g).sum() * 2, **TOL)


def test_jax_op_in_torch_compile_with_constants_and_structures():
    """Dynamo does not trace the JAX function: the call is one opaque call in the graph, traced by AOTAutograd."""
    tree = torch.tpu.pallas.jax_op("torchtpu_test::compiled_tree",
                                   lambda x, ws, *, power=2: {"p": x ** power, "terms": [x * w for w in ws]})

    def fn(x, y):
        a, b = scale_add(x.sin(), y.clone(), 2.0, torch.bfloat16)
        return a.float().cos() + b + tree(x, [y, y], power=3)["terms"][1]

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    compiled = torch.compile(fn, backend="tpu", fullgraph=True)
    for _ in range(2):
        out = compiled(x.to(DEVICE), y.to(DEVICE))
    torch.testing.assert_close(out.cpu(), fn(x, y), atol=1e-2, rtol=1e-2)


def test_jax_op_structures_keyword_constants_and_autograd():
    @torch.tpu.pallas.jax_op("torchtpu_test::tree")
    def tree(x: jax.Array, ws: list[jax.Array], *, power: int = 2) -> dict:
        return {"p": x ** power, "terms": [x * w for w in ws], "none": None}

    x, w1, w2 = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2)
    xd = x.to(DEVICE).requires_grad_()
    out = tree(xd, [w1.to(DEVICE), w2.to(DEVICE)], power=3)
    assert set(out) == {"p", "terms", "none"} and out["none"] is None and len(out["terms"]) == 2
    torch.testing.assert_close(out["p"].detach().cpu(), x ** 3, **TOL)
    torch.testing.assert_close(out["terms"][1].detach().cpu(), x * w2, **TOL)
    (out["p"].sum() + out["terms"][0].sum()).backward()
    torch.testing.assert_close(xd.grad.cpu(), 3 * x ** 2 + w1, **TOL)
    squares = tree(x.to(DEVICE), [w1.to(DEVICE)])  # the default power
    torch.testing.assert_close(squares["p"].cpu(), x ** 2, **TOL)


def test_jax_op_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="does not contain a namespace"):
        torch.tpu.pallas.jax_op("no_namespace", _scale_add)
    with pytest.raises(ValueError, match="exactly one"):
        torch.tpu.pallas.jax_op("a::b::c", _scale_add)
    for kwargs in (dict(mesh=object()), dict(input_partition_specs=(("x",),)),
                   dict(output_partition_specs=(("x",),))):
        with pytest.raises(NotImplementedError, match="one device"):
            torch.tpu.pallas.jax_op("torchtpu_test::sharded", _scale_add, **kwargs)
    with pytest.raises(ValueError, match="not a positional parameter"):
        torch.tpu.pallas.jax_op("torchtpu_test::bad_donation", _scale_add, donate_argnums=(4,))
    with pytest.raises(TypeError, match="hashable"):
        scale_add(torch.ones(2, device=DEVICE), torch.ones(2, device=DEVICE), {"a": 1}, torch.float32)


def test_custom_jax_kernel_is_a_deprecated_alias_with_explicit_constants():
    pallas_impl._warned_custom_jax_kernel = False
    with pytest.warns(FutureWarning, match="use torch.tpu.pallas.jax_op"):
        power = pallas_impl.custom_jax_kernel(lambda x, n: x ** n, static_argnums=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        shift = pallas_impl.custom_jax_kernel(lambda x, y: x + y)
    x = torch.randn(5)
    torch.testing.assert_close(power(x.to(DEVICE), 3).cpu(), x ** 3, **TOL)
    torch.testing.assert_close(shift(x.to(DEVICE), x.to(DEVICE)).cpu(), 2 * x, **TOL)
    with pytest.raises(TypeError, match="only support torch.Tensor and None"):
        shift(x.to(DEVICE), 2.0)
    with pytest.raises(ValueError, match="marked as static"):
        power(x.to(DEVICE), x.to(DEVICE))
    # input_output_aliases: the output is written into the input
    bump = pallas_impl.custom_jax_kernel(lambda t: t + 1, input_output_aliases={0: 0}, warn_deprecated=False)
    t = x.to(DEVICE)
    bump(t)
    torch.testing.assert_close(t.cpu(), x + 1, **TOL)
    with pytest.raises(ValueError, match="donate_argnums"):
        pallas_impl.custom_jax_kernel(lambda t: t, input_output_aliases={0: 0}, donate_argnums=[1])


# ---- torch.tpu.ops --------------------------------------------------------------------------------------

def test_optimization_barrier_is_an_identity_with_gradients():
    x, y = torch.randn(3, 4), torch.arange(6, dtype=torch.int32)
    xd = x.to(DEVICE).requires_grad_()
    a, b = torch.tpu.ops.optimization_barrier([xd * 2, y.to(DEVICE)])
    assert b.dtype == torch.int32 and a.shape == (3, 4)
    torch.testing.assert_close(b.cpu(), y, atol=0, rtol=0)
    torch.testing.assert_close(a.detach().cpu(), x * 2, atol=0, rtol=0)
    (a * a).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), 8 * x, **TOL)
    assert torch.tpu.ops.optimization_barrier([]) == []


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_pool_and_its_backward_match_cpu(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, 3, *[9 - n] * n, generator=gen)
    pool, back = getattr(torch.tpu.ops, f"max_pool{n}d"), getattr(torch.tpu.ops, f"max_pool{n}d_backward")
    for kernel, stride, padding, dilation, ceil_mode in (([2] * n, [2] * n, [0] * n, [1] * n, False),
                                                         ([3] * n, [2] * n, [1] * n, [1] * n, True),
                                                         ([2] * n, [1] * n, [0] * n, [2] * n, False)):
        cpu_pool = getattr(F, f"max_pool{n}d")
        xc = x.clone().requires_grad_()
        want = cpu_pool(xc, kernel, stride, padding, dilation, ceil_mode)
        got = pool(x.to(DEVICE), kernel, stride, padding, dilation, ceil_mode)
        torch.testing.assert_close(got.cpu(), want.detach(), atol=0, rtol=0)
        grad_out = torch.randn(want.shape, generator=gen)
        want.backward(grad_out)
        got_grad = back(grad_out.to(DEVICE), x.to(DEVICE), kernel, stride, padding, dilation, ceil_mode)
        torch.testing.assert_close(got_grad.cpu(), xc.grad, **TOL)


def _ragged_reference(lhs, rhs, sizes):
    out, start = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64), 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
        start += size
    return out


def test_ragged_dot_and_weight_grad_match_numpy():
    gen = torch.Generator().manual_seed(5)
    sizes = [3, 0, 5, 2]  # an empty group
    lhs, rhs = torch.randn(10, 6, generator=gen), torch.randn(4, 6, 5, generator=gen)
    group_sizes = torch.tensor(sizes)
    want = _ragged_reference(lhs.numpy(), rhs.numpy(), sizes)
    ld, rd = lhs.to(DEVICE).requires_grad_(), rhs.to(DEVICE).requires_grad_()
    got = torch.tpu.ops.ragged_dot(ld, rd, group_sizes.to(DEVICE))
    np.testing.assert_allclose(got.detach().cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    out = torch.empty(10, 5, device=DEVICE)
    assert torch.tpu.ops.ragged_dot(lhs.to(DEVICE), rhs.to(DEVICE), group_sizes.to(DEVICE), out=out) is out
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    # gradients: against the CPU's autograd of the per-group products
    grad_out = torch.randn(10, 5, generator=gen)
    got.backward(grad_out.to(DEVICE))
    lc, rc = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    starts = np.cumsum([0] + sizes)
    torch.cat([lc[starts[g]:starts[g + 1]] @ rc[g] for g in range(4)]).backward(grad_out)
    torch.testing.assert_close(ld.grad.cpu(), lc.grad, **TOL)
    torch.testing.assert_close(rd.grad.cpu(), rc.grad, **TOL)
    weight_grad = torch.tpu.ops.ragged_dot_weight_grad(lhs.to(DEVICE), grad_out.to(DEVICE), group_sizes.to(DEVICE))
    assert weight_grad.shape == (4, 6, 5)
    torch.testing.assert_close(weight_grad.cpu(), rc.grad, **TOL)


def _attention_reference(q, k, v, scale, window, causal):
    reps = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, reps, axis=1), np.repeat(v, reps, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    i = np.arange(q.shape[2])
    distance = i[:, None] - i[None, :]
    allowed = np.ones_like(distance, bool)
    if window is not None:
        allowed = (distance >= 0) & (distance <= window)
    elif causal:
        allowed = distance >= 0
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_splash_sdpa_matches_masked_softmax_attention(kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 12, 8, generator=gen)
    k, v = torch.randn(2, kv_heads, 12, 8, generator=gen), torch.randn(2, kv_heads, 12, 8, generator=gen)
    gqa = kv_heads != 4
    for kwargs in (dict(), dict(local_window_size=3), dict(is_causal=False, scale=0.25),
                   dict(local_window_size=20, block_q=128, q_layout="SEQ_MINOR")):
        got = torch.tpu.ops.splash_sdpa(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), enable_gqa=gqa, **kwargs)
        want = _attention_reference(q.numpy(), k.numpy(), v.numpy(), kwargs.get("scale"),
                                    kwargs.get("local_window_size"), kwargs.get("is_causal", True))
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="enable_gqa"):
        torch.tpu.ops.splash_sdpa(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), enable_gqa=not gqa)
    with pytest.raises(ValueError, match="layout"):
        torch.tpu.ops.splash_sdpa(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), enable_gqa=gqa, k_layout="ROWS")


# ---- torch.tpu.distributed and the collectives of torch.tpu.ops ------------------------------------------

@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_spmd_safe_runs_the_pending_ops_before_and_after():
    calls = []

    @torch.tpu.distributed.spmd_safe
    def body(t):
        """body's docstring"""
        calls.append(torch_pjrt.metrics()["graphs"])
        return t * 2

    assert body.__doc__ == "body's docstring"
    with torch_pjrt.mode("fused"):
        x = torch.randn(4, device=DEVICE)
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        pending = x + 1  # recorded, not run
        out = body(pending)
        assert calls == [1]  # the graph computing `pending` ran before the body
        assert torch_pjrt.metrics()["graphs"] == 2  # and the body's own ops after it
        torch.testing.assert_close(out.cpu(), (x.cpu() + 1) * 2, **TOL)


TWO_RANKS = textwrap.dedent(r"""
    import os, sys, torch, torch.distributed as dist, torch_pjrt
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = torch.tpu.ops

    def full(r):
        return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r

    x = full(rank).to("tpu")
    for dim in (0, 1, -1):
        got = ops.all_gather_dim(x, dim)
        assert torch.equal(got.cpu(), torch.cat([full(0), full(1)], dim)), dim
    total = full(0) + full(1)
    assert torch.equal(ops.reduce_scatter_dim(x, 2).cpu(), total.narrow(2, rank * 2, 2))
    tall = full(rank).repeat(1, 2, 1).to("tpu")  # [2, 6, 4]
    assert torch.equal(ops.reduce_scatter_dim(tall, -2).cpu(), total.repeat(1, 2, 1).narrow(1, rank * 3, 3))
    assert torch.equal(ops.reduce_scatter_dim(x, 2, reduce_op="max").cpu(), full(1).narrow(2, rank * 2, 2))
    assert torch.allclose(ops.reduce_scatter_dim(x, 2, reduce_op="avg").cpu(), (total / 2).narrow(2, rank * 2, 2))
    bits = torch.tensor([[1 + 2 * rank, 6 - rank, 12, 5]], dtype=torch.int32)
    want = torch.tensor([[1 | 3, 6 | 5, 12, 5]], dtype=torch.int32).narrow(1, rank * 2, 2)
    assert torch.equal(ops.reduce_scatter_dim(bits.to("tpu"), 1, reduce_op="bor").cpu(), want)
    for bad, kwargs in (("integer", dict(dim=2, reduce_op="band")), ("divisible", dict(dim=1)),
                        ("reduce_op must be", dict(dim=2, reduce_op="mean"))):
        try:
            ops.reduce_scatter_dim(x, **kwargs)
            raise AssertionError(bad)
        except ValueError as e:
            assert bad in str(e), e

    # send / recv: rank 0 sends two tensors to rank 1 under a tag
    if rank == 0:
        ops.send([x, x.int() * 2], 1, 7).wait()
    else:
        into = [torch.zeros(2, 3, 4, device="tpu"), torch.zeros(2, 3, 4, dtype=torch.int32, device="tpu")]
        ops.recv(into, 0, 7).wait()
        assert torch.equal(into[0].cpu(), full(0)) and torch.equal(into[1].cpu(), full(0).int() * 2)

    # ragged_all_to_all: rank r sends operand rows [in_off[j], + send[j]) to rank j, at out_off[j] there
    spec = {0: ([0, 2], [2, 3], [1, 0]), 1: ([1, 3], [1, 2], [4, 3])}  # rank: (in_off, send, out_off)
    operands = [torch.arange(10, dtype=torch.float32).reshape(5, 2) + 100 * r for r in range(2)]
    weights = [torch.arange(12, dtype=torch.float32).reshape(6, 2) + 1000 * r for r in range(2)]
    want, want_grad = torch.full((6, 2), -1.0), torch.zeros(5, 2)
    for src in range(2):
        in_off, send, out_off = spec[src]
        if src == rank:  # the gradient of sum(result * weight) on the receivers, back at the sent rows
            for j in range(2):
                want_grad[in_off[j]:in_off[j] + send[j]] = weights[j][out_off[j]:out_off[j] + send[j]]
        want[out_off[rank]:out_off[rank] + send[rank]] = operands[src][in_off[rank]:in_off[rank] + send[rank]]
    in_off, send, out_off = (torch.tensor(v, device="tpu") for v in spec[rank])
    recv = torch.tensor([spec[0][1][rank], spec[1][1][rank]], device="tpu")
    operand = operands[rank].to("tpu").requires_grad_(True)
    got = ops.ragged_all_to_all(operand, torch.full((6, 2), -1.0, device="tpu"), in_off, send, out_off, recv,
                                dist.group.WORLD.group_name)
    assert torch.equal(got.detach().cpu(), want), (rank, got, want)
    (got * weights[rank].to("tpu")).sum().backward()
    assert torch.equal(operand.grad.cpu(), want_grad), (rank, operand.grad, want_grad)
    into = torch.zeros(6, 2, device="tpu")
    res = ops.ragged_all_to_all(operand.detach(), torch.full((6, 2), -1.0, device="tpu"), in_off, send, out_off,
                                recv, "", out=into)
    assert res is into and torch.equal(into.cpu(), want)

    mesh = torch.tpu.distributed.topology_aware_mesh((1, 2))
    assert mesh.dtype == torch.int64 and mesh.tolist() == [[0, 1]]
    assert torch.tpu.distributed.topology_aware_mesh((2,), dcn_mesh_shape=(1,)).tolist() == [0, 1]
    for shape, dcn in (((4,), None), ((2,), (2,))):
        try:
            torch.tpu.distributed.topology_aware_mesh(shape, dcn_mesh_shape=dcn)
            raise AssertionError(shape)
        except ValueError:
            pass
    dist.barrier()
    dist.destroy_process_group()
    print(f"RANK_OK {rank}")
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.modes_inside  # launches its ranks in the fused pass only
@pytest.mark.timeout(300)
def test_collectives_send_recv_and_mesh_on_two_ranks(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                  TORCH_PJRT_MODE=torch_pjrt.get_mode()))
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RANK_OK {r}" in out, f"rank {r}: {out[-2000:]}{err[-4000:]}"


# ---- torch.tpu.profiler ---------------------------------------------------------------------------------

def test_tpu_profiler_config_is_accepted_by_torch_profiler(tmp_path):
    from torch.tpu.profiler import TpuProfilerConfig

    config = TpuProfilerConfig(host_tracer_level=3, run_dir=tmp_path, worker_rank="0",
                               experimental_options={"some_option": True})
    assert (config.host_tracer_level, config.device_tracer_level, config.run_dir) == (3, 1, str(tmp_path))
    x = torch.randn(7, 13)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        y = (x.to(DEVICE).cos() + 1).cpu()
    torch.testing.assert_close(y, x.cos() + 1, **TOL)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("torch_pjrt::execute(") for n in names), sorted(names)[:20]
    with pytest.raises(TypeError, match="worker_rank must be a string"):
        TpuProfilerConfig(worker_rank=0)
    with pytest.raises(ValueError, match="cannot contain"):
        TpuProfilerConfig(worker_rank="a:b")
    with pytest.raises(ValueError, match="clash"):
        TpuProfilerConfig(experimental_options={"run_dir": "x"})
