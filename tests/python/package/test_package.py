"""The Python package: install metadata, autoload from `import torch`, `python -m torch_pjrt`, torch.tpu.

Subprocesses run from a temporary directory so nothing comes from the
current directory; they see the package through PYTHONPATH (or an installed
wheel) exactly as a user's interpreter would.
"""
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

import torch_pjrt

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # tests/python/<layer>/ -> repo
PYTHON_DIR = os.path.join(ROOT, "python")

# Subprocess tests do not depend on the parent's mode: `make test` runs them once.
in_one_pass = pytest.mark.modes_inside


def run_python(code_or_args, cwd, pythonpath, returncode=0, **env):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    environ.update(PYTHONPATH=os.pathsep.join(pythonpath), **env)
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=240)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def torch_backends_entry_point():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return project["entry-points"]["torch.backends"]


def test_entry_point_metadata_names_a_callable_of_the_package():
    points = torch_backends_entry_point()
    assert list(points) == ["torch_pjrt"]
    module_name, _, attribute = points["torch_pjrt"].partition(":")
    target = getattr(importlib.import_module(module_name), attribute)
    assert callable(target)
    target()  # PyTorch calls it after loading; it must not fail once the package is imported


def write_distribution(site, name="torch_pjrt_autoload_probe"):
    """A minimal installed distribution that declares the package's torch.backends entry point."""
    info = os.path.join(site, f"{name}-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[torch.backends]\n" + "".join(f"{k} = {v}\n" for k, v in torch_backends_entry_point().items()))


AUTOLOAD_PROBE = """
import sys
import torch
loaded = "torch_pjrt" in sys.modules
print("loaded", loaded)
if loaded:
    print("values", (torch.arange(4.0, device="tpu") * 2).cpu().tolist())
"""


@in_one_pass
def test_import_torch_autoloads_the_backend_through_the_entry_point(tmp_path):
    site = tmp_path / "site"
    write_distribution(str(site))
    out = run_python(AUTOLOAD_PROBE, cwd=tmp_path, pythonpath=[str(site), PYTHON_DIR])
    assert "loaded True" in out
    assert "values [0.0, 2.0, 4.0, 6.0]" in out
    # PyTorch's switch turns it off.
    out = run_python(AUTOLOAD_PROBE, cwd=tmp_path, pythonpath=[str(site), PYTHON_DIR], TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert "loaded False" in out
    # Without the entry point (not installed), `import torch` does not import it.
    out = run_python(AUTOLOAD_PROBE, cwd=tmp_path, pythonpath=[PYTHON_DIR])
    assert "loaded False" in out


@in_one_pass
def test_importing_the_package_first_with_autoload_on(tmp_path):
    # torch's autoload then finds the half-imported package: the import must still complete.
    site = tmp_path / "site"
    write_distribution(str(site))
    code = "import torch_pjrt, torch; print('values', (torch.ones(2, device='tpu') + 1).cpu().tolist(), torch_pjrt.get_mode())"
    out = run_python(code, cwd=tmp_path, pythonpath=[str(site), PYTHON_DIR])
    assert "values [2.0, 2.0]" in out


def diagnosis_fields(out):
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


@in_one_pass
def test_python_m_torch_pjrt_prints_a_diagnosis(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "entry").write_bytes(b"x" * 1234)
    out = run_python(["-m", "torch_pjrt"], cwd=tmp_path, pythonpath=[PYTHON_DIR],
                     TORCH_PJRT_CACHE_DIR=str(cache), TORCH_PJRT_MODE="strict")
    fields = diagnosis_fields(out)
    info = torch_pjrt.platform()
    assert os.path.samefile(fields["plugin"], torch_pjrt._C._plugin_path())
    assert fields["platform"] == f"{info['name']} {info['version']}"
    assert fields["PJRT C API version"] == info["api_version"]
    assert fields["devices"].startswith(f"{torch.tpu.device_count()} (tpu:0")
    assert fields["torch"].startswith(torch.__version__ + " ")
    assert fields["mode"] == "strict"
    assert fields["health"] == "ok"  # and exit status 0 (run_python)
    assert os.path.samefile(fields["torch_pjrt"], os.path.dirname(torch_pjrt.__file__))
    files, size = re.fullmatch(r".* \((\d+) files, (\d+) bytes\)", fields["compile cache"]).groups()
    assert fields["compile cache"].startswith(str(cache))
    assert (int(files), int(size)) == (1, 1234)


@in_one_pass
def test_python_m_torch_pjrt_exits_1_when_the_plugin_cannot_load(tmp_path):
    """A health check: a file that is no plugin (found, so only starting the device fails) gives exit status 1,
    the diagnosis still printed and the reason on the last line. Bad settings: the test below."""
    not_a_plugin = tmp_path / "not_a_plugin.so"
    not_a_plugin.write_bytes(b"not a shared library")
    out = run_python(["-m", "torch_pjrt"], cwd=tmp_path, pythonpath=[PYTHON_DIR], returncode=1,
                     TORCH_PJRT_PLUGIN=str(not_a_plugin))
    fields = diagnosis_fields(out)
    assert fields["plugin variable"] == f"TORCH_PJRT_PLUGIN={not_a_plugin}"
    assert "could not load PJRT plugin" in fields["health"], out
    assert out.splitlines()[-1].startswith("health: ")


def build_is_up_to_date(build_dir):
    if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")) or shutil.which("ninja") is None:
        return False
    dry = subprocess.run(["ninja", "-C", build_dir, "-n", "_C"], capture_output=True, text=True)
    return dry.returncode == 0 and "no work to do" in dry.stdout


@in_one_pass
def test_wheel_installs_and_autoloads(tmp_path):
    """pip wheel --no-build-isolation: packages the extension the CMake build made (seconds when it is built)."""
    if not build_is_up_to_date(os.path.join(ROOT, "build")):
        pytest.skip("./build is not an up-to-date CMake build of _C: a wheel build here would compile for minutes")
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.skip("setuptools >= 70.1 (with bdist_wheel) is needed to build the wheel")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(wheels), ROOT], check=True, timeout=60, cwd=tmp_path)
    (wheel,) = wheels.glob("torch_pjrt-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=60)
    assert (site / "torch_pjrt" / "_C.so").exists()
    # The installed copy alone (no source tree on the path): `import torch` loads it.
    out = run_python(AUTOLOAD_PROBE + "import torch_pjrt; print('from', torch_pjrt.__file__)",
                     cwd=tmp_path, pythonpath=[str(site)])
    assert "values [0.0, 2.0, 4.0, 6.0]" in out
    assert f"from {site}" in out


# ---- torch.tpu: what transformers' testing_utils and torch.accelerator look for.

def storage_bytes(*tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_memory_statistics_count_live_storages():
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    a = torch.empty(1000, device="tpu")
    b = torch.ones(10, 30, dtype=torch.float64, device="tpu")
    c = b[2:5].t()  # a view: no new storage
    assert torch.tpu.memory_allocated() - base == storage_bytes(a, b) == 4000 + 2400
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated()
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    assert stats["reserved_bytes.all.current"] == torch.tpu.memory_reserved() == torch.tpu.memory_allocated()
    count = stats["allocation.all.current"]
    del a
    assert torch.tpu.memory_allocated() - base == 2400
    assert torch.tpu.memory_stats()["allocation.all.current"] == count - 1
    assert torch.tpu.max_memory_allocated() >= base + 6400
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == torch.tpu.memory_allocated()
    b.resize_(20, 30)  # the storage grows: counted
    assert torch.tpu.memory_allocated() - base == 4800
    del b, c
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() - base == 4800


def test_memory_of_results_and_freed_intermediates():
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    x = torch.randn(64, 64, device="tpu")
    y = (x @ x).relu() + 1
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() - base == storage_bytes(x, y) == 2 * 64 * 64 * 4
    del x, y
    torch.tpu.synchronize()
    assert torch.tpu.memory_allocated() == base


def test_transformers_device_agnostic_helpers_work_on_tpu():
    testing_utils = pytest.importorskip("transformers.testing_utils")
    assert testing_utils.backend_device_count("tpu") == torch.tpu.device_count() >= 1
    testing_utils.backend_manual_seed("tpu", 1234)
    first = torch.rand(5, device="tpu").cpu()
    torch.tpu.manual_seed(1234)
    assert torch.equal(first, torch.rand(5, device="tpu").cpu())
    testing_utils.backend_synchronize("tpu")
    testing_utils.backend_empty_cache("tpu")
    assert testing_utils.backend_torch_accelerator_module("tpu") is torch.tpu
    for name in ("manual_seed", "device_count", "empty_cache", "memory_allocated", "max_memory_allocated",
                 "reset_peak_memory_stats", "memory_stats", "synchronize", "is_available", "current_device",
                 "memory_reserved", "max_memory_reserved", "reset_max_memory_allocated", "is_bf16_supported"):
        assert callable(getattr(torch.tpu, name)), name
    assert torch.tpu.is_available() and torch.tpu.current_device() == 0


# ---- A bad setting never breaks `import torch`: it warns, `tpu` is unavailable, the diagnosis says why.

BAD_SETTING_PROBE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch
import sys
print("loaded", "torch_pjrt" in sys.modules)
print("warned", any("tpu device is unavailable" in str(w.message) for w in caught))
print("available", torch.tpu.is_available())
try:
    torch.ones(2, device="tpu")
except RuntimeError as e:
    print("raises", str(e).splitlines()[0])
"""


@in_one_pass
@pytest.mark.parametrize("setting", [{"TORCH_PJRT_PLUGIN": "no-such-platform"},
                                     {"TORCH_PJRT_PLUGIN": "/no/such/plugin.so"},
                                     {"TORCH_PJRT_MODE": "fusd"}])
def test_a_bad_setting_warns_at_import_torch_and_leaves_tpu_unavailable(tmp_path, setting):
    site = tmp_path / "site"
    write_distribution(str(site))
    (name, value), = setting.items()
    out = run_python(BAD_SETTING_PROBE, cwd=tmp_path, pythonpath=[str(site), PYTHON_DIR], **setting)
    assert "loaded True" in out and "warned True" in out and "available False" in out, out
    raised = re.search(r"^raises (.*)$", out, re.M).group(1)
    assert f"{name}={value!r}" in raised, raised  # the error names the setting
    out = run_python(["-m", "torch_pjrt"], cwd=tmp_path, pythonpath=[PYTHON_DIR], returncode=1, **setting)
    fields = diagnosis_fields(out)
    assert f"{name}={value!r}" in fields["unavailable"]
    assert f"{name}={value!r}" in fields["health"]  # the last line of a failed health check
    assert fields["torch_pjrt version"] == torch_pjrt.__version__


@in_one_pass
def test_import_and_first_use_print_no_plugin_log_lines(tmp_path):
    code = "import torch, torch_pjrt; print((torch.ones(3, device='tpu') * 2).sum().item())"
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=dict(environ, PYTHONPATH=PYTHON_DIR))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "6.0"
    assert "absl" not in proc.stderr and not re.search(r"^I\d{4} ", proc.stderr, re.M), proc.stderr


def test_version_is_the_package_metadata_version():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" in project["project"]["dynamic"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch_pjrt.__version__)


def test_device_properties_and_memory_info_as_torch_cuda_gives_them():
    props = torch.tpu.get_device_properties()
    assert props.name == torch_pjrt._C._device_kind(0)
    free, total = torch.tpu.mem_get_info()
    assert props.total_memory == total and 0 < free <= total
    if torch_pjrt.platform()["name"] == "cpu":  # the device's memory is the host's
        assert total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        with open("/proc/meminfo") as f:
            available = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
        assert abs(free - available) <= 0.1 * total
    # torch.accelerator's memory info (vLLM sizes its KV cache from it) is the device module's
    accel_free, accel_total = torch.accelerator.get_memory_info("tpu")
    assert accel_total == total and abs(accel_free - free) <= 0.1 * total
    assert torch.tpu.get_device_capability() == (props.major, props.minor)
    assert torch.get_device_module("tpu").get_device_properties("tpu:0").total_memory == total
    with pytest.raises(RuntimeError, match="invalid tpu device index"):
        torch.tpu.get_device_properties(torch.tpu.device_count())
    x = torch.ones(1 << 20, device="tpu")
    summary = torch.tpu.memory_summary()
    assert f"{torch.tpu.memory_allocated() / (1 << 20):,.1f} MiB" in summary
    del x
    assert torch.tpu.OutOfMemoryError is torch.OutOfMemoryError
    torch.tpu.init()
    assert torch.tpu.is_initialized()


@in_one_pass
def test_install_with_an_old_setuptools_says_what_to_do(tmp_path):
    """A new venv's setuptools has no bdist_wheel; --no-build-isolation skips pyproject's requirement."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    version = subprocess.run([python, "-c", "import setuptools; print(setuptools.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    if not version or tuple(int(p) for p in version.split(".")[:2]) >= (70, 1):
        pytest.skip(f"this Python's venv comes with setuptools {version or 'none'}")
    proc = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", ROOT],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode != 0
    assert "needs setuptools>=70.1" in proc.stdout + proc.stderr and "invalid command" not in proc.stdout + proc.stderr


def test_safetensors_loads_onto_tpu_by_device_index(tmp_path):
    """safetensors knows a fixed list of device names ('tpu' is not one); an index
    names the current accelerator, which is tpu (docs/design/package-and-profiling.md)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(3, 4), "ids": torch.arange(5)}
    path = str(tmp_path / "x.safetensors")
    safetensors_torch.save_file(tensors, path)
    loaded = safetensors_torch.load_file(path, device=torch.tpu.current_device())
    for name, t in tensors.items():
        assert loaded[name].device.type == "tpu" and torch.equal(loaded[name].cpu(), t)


def test_every_subpackage_is_in_the_wheel():
    # A subpackage missing from pyproject's list is left out of the wheel, and `import torch_pjrt` fails there.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    base = os.path.join(ROOT, "python")
    found = {os.path.relpath(d, base).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(base, "torch_pjrt"))
             if "__init__.py" in files}
    assert found == listed
