"""Helion kernels on tpu tensors: run inside torch_pjrt's programs through Helion's pure-JAX view.

Helion (`helion` on PyPI) compiles a kernel for the backend its settings name (`backend=` or HELION_BACKEND,
Triton by default). Its Pallas backend also gives a pure-JAX view of a kernel, `Kernel.jax_fn`: a function of
JAX arrays that runs Helion's generated host code on shape-only stand-ins and calls the Pallas kernel on the
arrays, so it can be traced by `jax.jit`. Helion's own launcher, given tpu tensors, copies them to the host
for JAX and back (TorchTPU's bridge, which torch_pjrt does not have).

After `import torch_pjrt`, `install()` patches `helion.runtime.kernel.Kernel.__call__` when (and if) Helion is
imported (`_after_import`): a call whose tensors are on `tpu` runs the kernel's JAX view as a `jax_op`
(`torch.tpu.pallas.jax_op`'s machinery: tensors traced, every other argument a constant, one op per set of
constants), so the kernel is lowered to StableHLO and inlined into the tpu program with the ops around it, in
eager (strict, fused, lazy) and compiled (`torch.compile(backend="tpu")`) mode; nothing goes through the host.
Under torch.compile, Dynamo puts Helion's own higher-order op in the graph; when the compiled graph runs,
that op calls the kernel, which takes the same path. Calls with CPU (or other) tensors are Helion's own.

The tpu call always uses Helion's Pallas backend, whatever backend the kernel names for its other devices
(a twin `Kernel` with the same function, configs and settings but `backend="pallas"`). Where the PJRT platform
is not a TPU (the CPU and GPU plugins) the twin uses Pallas interpret mode (`pallas_interpret=True`): the
grid becomes a `stablehlo.while` over dynamic slices, plain StableHLO that any plugin runs (Mosaic, Pallas's
TPU compiler, runs only on TPUs). Autotuning benchmarks configs on the device, which the JAX view cannot do:
a kernel that would autotune (no `config=`, `autotune_effort` not "none") runs on tpu with its first config,
or Helion's default one, and says so once (a warning).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import threading
import warnings
import weakref

import torch

from .._after_import import after_import

_KERNEL_MODULE = "helion.runtime.kernel"
_JAX_EXPORT_MODULE = "helion.runtime.pallas.jax_export"
_lock = threading.Lock()
_tpu_kernels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # helion Kernel -> _TpuKernel
_ids = itertools.count()


def _on_tpu(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "tpu"
    if isinstance(value, (list, tuple)):
        return any(_on_tpu(v) for v in value)
    if isinstance(value, dict):
        return any(_on_tpu(v) for v in value.values())
    return False


def interpret() -> bool:
    """Whether tpu calls use Pallas interpret mode: everywhere but on a TPU PJRT plugin."""
    from .. import platform

    return platform()["name"] != "tpu"


def _resolves_without_benchmark(settings, configs) -> bool:
    """Whether Helion picks the kernel's config without running it: one config, or no autotuning."""
    if settings.force_autotune:
        return False
    if settings.autotune_effort == "none":
        return len(configs) <= 1
    return len(configs) == 1


class _TpuKernel:
    """A Helion kernel's tpu path: its Pallas twin's JAX view as a torch.tpu.pallas jax op."""

    def __init__(self, kernel):
        from ..torchtpu.pallas import _Kernel

        settings = kernel.settings
        configs = list(kernel.configs)
        wanted = dict(backend="pallas", pallas_interpret=interpret())
        if not _resolves_without_benchmark(settings, configs):
            warnings.warn(f"Helion kernel {getattr(kernel.fn, '__name__', kernel)!r} on tpu: autotuning cannot "
                          "benchmark through the kernel's JAX view, so the tpu call uses "
                          + ("its first config" if configs else "Helion's default config")
                          + " (give it config= or autotune_effort='none' to choose)", stacklevel=5)
            configs = configs[:1]
            wanted.update(autotune_effort="none", force_autotune=False)
        if all(getattr(settings, k) == v for k, v in wanted.items()):
            self.twin = kernel
        else:
            self.twin = type(kernel)(kernel.fn, configs=configs, settings=dataclasses.replace(settings, **wanted),
                                     key=getattr(kernel, "_key_fn", None))
        self.name = getattr(kernel.fn, "__name__", "kernel")
        self.jax_op = _Kernel(f"helion::{re.sub(r'[^0-9A-Za-z_]', '_', self.name)}_{next(_ids)}", self.twin.jax_fn)
        self.written = _written_arguments(kernel)

    def __call__(self, args):
        if self.written:
            raise NotImplementedError(
                f"Helion kernel {self.name!r} writes its argument(s) {', '.join(self.written)} in place: on tpu it "
                "runs as its JAX view, whose results are new arrays (the written arguments are not among them); "
                "return the results instead")
        return self.jax_op(*args)


def _written_arguments(kernel) -> list:
    """The parameters the kernel's body writes in place (x[tile] = ..., hl.atomic_add(x, ...)), as Helion finds them."""
    try:
        import ast
        import inspect
        import textwrap

        from helion._compiler._dynamo.variables import _detect_mutated_inputs

        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        return list(_detect_mutated_inputs(body, set(kernel.signature.parameters)))
    except Exception:  # another Helion version, or no source: the call itself will fail or succeed
        return []


def tpu_kernel(kernel) -> _TpuKernel:
    """The tpu path of a Helion kernel (made once per kernel)."""
    with _lock:
        found = _tpu_kernels.get(kernel)
        if found is None:
            found = _tpu_kernels[kernel] = _TpuKernel(kernel)
        return found


def call_on_tpu(kernel, args, kwargs):
    """kernel(*args, **kwargs) for tpu tensors: its JAX view inlined into the tpu program."""
    return tpu_kernel(kernel)(kernel.normalize_args(*args, **kwargs))


def _patch(module) -> None:
    cls = module.Kernel
    original = cls.__call__
    if getattr(original, "_torch_pjrt", False):
        return

    def __call__(self, *args, **kwargs):
        if _on_tpu(args) or _on_tpu(kwargs):
            return call_on_tpu(self, args, kwargs)
        return original(self, *args, **kwargs)

    __call__._torch_pjrt = True
    __call__.__doc__ = original.__doc__
    __call__.__wrapped__ = original
    cls.__call__ = __call__


def _patch_jax_export(module) -> None:
    """The JAX view's stand-in tensors are on the CPU where kernels are interpreted.

    Helion gives the JAX view's shape-only stand-ins the `tpu` device whenever `torch.tpu` and an accelerator
    exist (TorchTPU). Its generated host code then makes a scalar argument a one-element tensor on that
    device and reads it back for JAX: two host transfers each time the kernel is traced. In interpret mode
    the stand-ins are CPU tensors, as in Helion's own interpret-mode runs, and so are those scalars.
    """
    original = module._device_for_jax_export
    if getattr(original, "_torch_pjrt", False):
        return

    def _device_for_jax_export():
        return torch.device("cpu") if interpret() else original()

    _device_for_jax_export._torch_pjrt = True
    module._device_for_jax_export = _device_for_jax_export


def install() -> None:
    """Routes Helion kernel calls on tpu tensors through their JAX view, once helion is imported."""
    after_import(_KERNEL_MODULE, _patch)
    after_import(_JAX_EXPORT_MODULE, _patch_jax_export)
