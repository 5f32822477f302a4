"""The device as PyTorch sees it: module, transfers, printing, save/load, errors."""
import os
import io
import subprocess
import sys
import warnings

import pytest
import torch

import torch_pjrt


def test_device_module():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    assert torch.device("tpu").type == "tpu"
    x = torch.ones(2, device="tpu")
    assert x.device == torch.device("tpu:0") and x.is_tpu
    torch.tpu.synchronize()
    # The platform the plugin reports is the one TORCH_PJRT_PLUGIN asked for.
    asked = os.environ.get("TORCH_PJRT_PLUGIN", "cpu")
    if asked in ("cpu", "cuda"):
        assert torch_pjrt.platform()["name"].lower() == asked


def test_accelerator_api():
    if not hasattr(torch, "accelerator"):
        pytest.skip("torch.accelerator missing")
    assert torch.accelerator.current_accelerator().type == "tpu"


def test_bad_device_index_raises():
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(2, device="tpu:7")
    with pytest.raises((RuntimeError, ValueError)):
        torch.tpu.set_device(9)


def test_round_trip_dtypes():
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.int8, torch.uint8, torch.bool]:
        x = (torch.randn(5, 3) * 10).to(dtype)
        t = x.to("tpu")
        assert t.dtype == dtype
        torch.testing.assert_close(t.cpu(), x)


def test_unsupported_dtype_raises():
    with pytest.raises((RuntimeError, TypeError), match="dtype|support"):
        torch.ones(2, dtype=torch.complex32).to("tpu").abs().cpu()  # no XLA type (complex64/128 work)


def test_non_blocking_and_to_dtype():
    x = torch.randn(4, 4)
    t = x.to("tpu", non_blocking=True)
    torch.testing.assert_close(t.to(torch.float64).cpu(), x.double())
    torch.testing.assert_close(t.to("cpu", non_blocking=True), x)


def test_item_tolist_and_printing():
    x = torch.arange(6.0).reshape(2, 3)
    t = x.to("tpu")
    assert t[1, 2].item() == 5.0
    assert t.tolist() == x.tolist()
    text = repr(t)
    assert "device='tpu:0'" in text and "5." in text
    assert not torch_pjrt.metrics()["cpu_fallbacks"].get("aten::masked_select")


def test_save_load_roundtrip_and_cpu_only_load(tmp_path):
    x = torch.randn(3, 4)
    t = x.to("tpu")
    path = tmp_path / "ck.pt"
    torch.save({"w": t, "row": t[1]}, path)
    loaded = torch.load(path)
    assert loaded["w"].device.type == "tpu"
    torch.testing.assert_close(loaded["w"].cpu(), x)
    torch.testing.assert_close(loaded["row"].cpu(), x[1])
    # A machine without the plugin loads the same file onto the CPU.
    code = f"import torch; d = torch.load({str(path)!r}, map_location='cpu'); print(d['w'].sum().item())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert abs(float(out) - x.sum().item()) < 1e-4


def test_cpu_fallback_is_counted_and_warned_once():
    torch_pjrt.reset_metrics()
    x = torch.tensor([3.0, 1.0, 2.0, 1.0])
    t = x.to("tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # unique_consecutive has no device path (unique has one since the MoE work).
        u1 = torch.unique_consecutive(t)
        u2 = torch.unique_consecutive(t)
    torch.testing.assert_close(u1.cpu(), torch.unique_consecutive(x))
    assert u2.device.type == "tpu"
    fallbacks = torch_pjrt.metrics()["cpu_fallbacks"]
    name = next(k for k in fallbacks if "unique" in k)
    assert fallbacks[name] == 2
    # One warning per op and process (it may have been raised by an earlier test).
    assert sum("unique" in str(w.message) for w in caught) <= 1


def test_metrics_count_compiles_and_cache_hits():
    torch_pjrt.reset_metrics()
    with torch_pjrt.mode("strict"):  # one execution per op (test_fused.py covers graphs)
        a = torch.randn(7, 5, device="tpu")
        for _ in range(3):
            a = a * 1.5 + 2.0
    m = torch_pjrt.metrics()
    assert m["executions"] >= 6
    assert m["op_cache_hits"] >= 4
    assert "compiles" in torch_pjrt.metrics_report()


def test_shape_error_is_a_python_exception():
    a = torch.randn(3, 4, device="tpu")
    b = torch.randn(5, 4, device="tpu")
    with pytest.raises(RuntimeError, match="size|broadcast"):
        (a + b).cpu()
    with pytest.raises(RuntimeError):
        a @ b


def test_mixed_device_error():
    a = torch.randn(3, device="tpu")
    b = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="device"):
        a + b


def test_rng_manual_seed_reproducible():
    torch.tpu.manual_seed(123)
    a = torch.randn(100, device="tpu")
    b = torch.rand(100, device="tpu")
    torch.tpu.manual_seed(123)
    a2 = torch.randn(100, device="tpu")
    b2 = torch.rand(100, device="tpu")
    torch.testing.assert_close(a.cpu(), a2.cpu())
    torch.testing.assert_close(b.cpu(), b2.cpu())
    assert not torch.equal(a.cpu(), b.cpu())
    state = torch.tpu.get_rng_state()
    c = torch.randn(10, device="tpu")
    torch.tpu.set_rng_state(state)
    torch.testing.assert_close(torch.randn(10, device="tpu").cpu(), c.cpu())


def test_random_distributions():
    torch.tpu.manual_seed(0)
    n = 20000
    u = torch.rand(n, device="tpu").cpu()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    z = torch.randn(n, device="tpu").cpu()
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05
    r = torch.randint(3, 9, (n,), device="tpu").cpu()
    assert r.min() == 3 and r.max() == 8 and r.dtype == torch.int64
    b = torch.empty(n, device="tpu").bernoulli_(0.3).cpu()
    assert abs(b.mean() - 0.3) < 0.02
    x = torch.ones(n, device="tpu")
    d = torch.nn.functional.dropout(x, 0.25, training=True).cpu()
    kept = d != 0
    assert abs(kept.float().mean() - 0.75) < 0.02
    torch.testing.assert_close(d[kept], torch.full_like(d[kept], 1 / 0.75))


def test_memory_stats():
    before = torch.tpu.memory_allocated()
    x = torch.empty(1024, device="tpu")
    assert torch.tpu.memory_allocated() >= before + 4096
    del x
    assert torch.tpu.memory_allocated() == before


def test_missing_plugin_is_a_clear_error():
    # Import warns (it must never break `import torch`, which imports this package when installed); the
    # first use raises a Python exception naming the setting, not a crash.
    code = "import torch, torch_pjrt\ntorch.ones(1, device='tpu')"
    env = {"TORCH_PJRT_PLUGIN": "/nonexistent/plugin.so", "PATH": "/usr/bin:/bin"}
    import os
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0
    assert "tpu device is unavailable" in r.stderr  # the warning at import
    assert "no such file" in r.stderr and "Traceback" in r.stderr and "RuntimeError" in r.stderr


def test_broken_plugin_is_a_clear_error(tmp_path):
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    code = "import torch, torch_pjrt\ntry:\n    torch.ones(1, device='tpu')\nexcept RuntimeError as e:\n    print('ERR', e)"
    import os
    env = dict(os.environ, TORCH_PJRT_PLUGIN=str(bogus), PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "bogus.so" in r.stdout


def test_plugin_platform_and_start_environment(monkeypatch):
    """The platform a TORCH_PJRT_PLUGIN value names picks the client's create options
    (plugins reject unknown ones) and the environment the plugin starts with."""
    from torch_pjrt._plugins import platform_of, prepare_environment

    assert [platform_of(p) for p in ("cpu", "cuda", "tpu")] == ["cpu", "cuda", "tpu"]
    assert platform_of("/env/jax_plugins/xla_cuda13/xla_cuda_plugin.so") == "cuda"
    assert platform_of("/env/libtpu/libtpu.so") == "tpu"
    assert platform_of("/opt/my_plugin.so") == ""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    prepare_environment("cpu")
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    prepare_environment("cuda")  # IEEE float32 division on the GPU, kept beside the user's flags, added once
    prepare_environment("cuda")
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_backend_extra_options=-nvptx-prec-divf32=2"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("TORCH_PJRT_GPU_IEEE_DIV", "0")
    prepare_environment("cuda")
    assert os.environ["XLA_FLAGS"] == ""
