"""Finds the PJRT plugin shared library for a platform name or a path."""
from __future__ import annotations

import glob
import importlib.util
import os

# Where the pip packages that ship each plugin put their .so.
_PACKAGES = {
    "cpu": [("xla_plugins.xla_cpu_pjrt", "xla_cpu_pjrt.so")],
    "cuda": [("jax_plugins.xla_cuda12", "xla_cuda_plugin.so"), ("jax_plugins.xla_cuda13", "xla_cuda_plugin.so")],
    "tpu": [("libtpu", "libtpu.so")],
}


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin) if spec.origin else None


def find_plugin(name_or_path: str) -> str:
    """Returns the plugin path for 'cpu', 'cuda', 'tpu' or an explicit .so path."""
    if os.sep in name_or_path or name_or_path.endswith(".so"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"TORCH_PJRT_PLUGIN={name_or_path!r}: no such file")
        return os.path.abspath(name_or_path)
    if name_or_path not in _PACKAGES:
        raise ValueError(
            f"unknown PJRT platform {name_or_path!r}: expected one of {sorted(_PACKAGES)} or a path to a plugin .so"
        )
    tried = []
    for package, filename in _PACKAGES[name_or_path]:
        directory = _package_dir(package)
        tried.append(package)
        if directory is None:
            continue
        candidates = [os.path.join(directory, filename)] + glob.glob(os.path.join(directory, "*.so"))
        for path in candidates:
            if os.path.isfile(path):
                return path
    hint = {"cpu": "pip install xla-cpu-pjrt==0.0.1", "cuda": "pip install jax[cuda12]", "tpu": "pip install libtpu"}
    raise RuntimeError(
        f"no PJRT plugin found for platform {name_or_path!r} (looked in {', '.join(tried)}): {hint[name_or_path]}"
    )


def platform_of(name_or_path: str) -> str:
    """The platform a TORCH_PJRT_PLUGIN value names ('cpu', 'cuda', 'tpu'; '' if unknown):
    it chooses the options the client is created with (plugins reject unknown ones)."""
    if name_or_path in _PACKAGES:
        return name_or_path
    base = os.path.basename(name_or_path).lower()
    for platform, hints in (("cpu", ("cpu",)), ("cuda", ("cuda", "gpu")), ("tpu", ("tpu",))):
        if any(h in base for h in hints):
            return platform
    return ""


def prepare_environment(platform: str) -> None:
    """Process environment a plugin reads when it starts (before the client exists).

    cuda: float32 division correctly rounded, as PyTorch's CUDA kernels divide
    (XLA:GPU's default `div.full` is off by an ulp: 6/7 gave 0.85714293, the CPU
    0.85714287). XLA reads XLA_FLAGS once, for every client in the process (JAX's
    too). TORCH_PJRT_GPU_IEEE_DIV=0 keeps XLA's default.
    """
    from . import _settings

    if platform != "cuda" or not _settings.flag("TORCH_PJRT_GPU_IEEE_DIV"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "nvptx-prec-divf32" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_extra_options=-nvptx-prec-divf32=2").strip()
