"""TorchTPU's names on torch.tpu itself: eager modes, matmul precision, device_of.

TorchTPU's three eager modes are torch_pjrt's modes under other names (TorchTPU's announcement calls them
Debug, Strict and Fused Eager):

    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING  "debug"   one op at a time, waits for each
    EagerMode.DEFER_NEVER                      "strict"  one op at a time, asynchronous
    EagerMode.DEFER_AND_FUSE                   "fused"   ops recorded and run as fused XLA graphs

torch_pjrt's "lazy" mode (graphs run only at sync() or when data is read) has no public TorchTPU name; while it
is on, torch.tpu.eager_mode is EagerMode._LAZY.
"""
from __future__ import annotations

import contextlib
import enum
import types
import warnings

import torch


class EagerMode(enum.Enum):
    """How eager tpu ops run (TorchTPU's names; the value is torch_pjrt's mode)."""

    DEFER_AND_FUSE = "fused"
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    _LAZY = "lazy"


def _mode_name(mode) -> str:
    try:
        return EagerMode(mode.value if isinstance(mode, EagerMode) else mode).value
    except ValueError:
        raise ValueError(f"expected a torch.tpu.EagerMode, got {mode!r}") from None


def _forbid_in_compile(what: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"torch.tpu.{what} cannot be used inside torch.compile: a compiled graph has one mode")


@contextlib.contextmanager
def set_eager_mode(mode):
    """Ops run in `mode` (an EagerMode) for the block: torch_pjrt.mode(), the process's mode, so autograd's
    backward thread runs in it too. The previous mode comes back after the block."""
    import torch_pjrt

    _forbid_in_compile("set_eager_mode")
    with torch_pjrt.mode(_mode_name(mode)):
        yield


class Precision(enum.Enum):
    """StableHLO dot/convolution precision for float32 (TorchTPU's names); the value is the
    torch.set_float32_matmul_precision setting that gives it here."""

    DEFAULT = "medium"
    HIGH = "high"
    HIGHEST = "highest"


@contextlib.contextmanager
def precision(mode):
    """float32 matmuls and convolutions on tpu use `mode` (a Precision) for the block.

    torch_pjrt's lowerings take the precision from torch.set_float32_matmul_precision, so the block sets that
    (process-wide, like the setting itself) and restores the previous value after it.
    """
    if not isinstance(mode, Precision):
        raise ValueError(f"expected one of Precision.DEFAULT, Precision.HIGH or Precision.HIGHEST, got {mode!r}")
    _forbid_in_compile("precision")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(mode.value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _device_module():
    from .. import device_module

    return device_module


@contextlib.contextmanager
def device_of(obj):
    """The current device is obj's (a tpu tensor or storage) for the block; a no-op for anything else."""
    index = -1
    if getattr(getattr(obj, "device", None), "type", None) == "tpu":
        index = obj.get_device()
    if index < 0:
        yield
        return
    with _device_module().device(index):
        yield


_warned_topology_alias = False


def topology_aware_mesh(mesh_shape, *, dcn_mesh_shape=None, allow_split_physical_axes=False,
                        contiguous_submeshes=False):
    """Deprecated (as in TorchTPU 0.2.0): torch.tpu.distributed.topology_aware_mesh."""
    global _warned_topology_alias
    if not _warned_topology_alias:
        _warned_topology_alias = True
        warnings.warn("torch.tpu.topology_aware_mesh is deprecated: use torch.tpu.distributed.topology_aware_mesh",
                      FutureWarning, stacklevel=2)
    from .distributed import topology_aware_mesh as mesh

    return mesh(mesh_shape, dcn_mesh_shape=dcn_mesh_shape, allow_split_physical_axes=allow_split_physical_axes,
                contiguous_submeshes=contiguous_submeshes)


class _TpuModule(types.ModuleType):
    """torch.tpu's class once installed: `torch.tpu.eager_mode` reads and sets the mode (as in TorchTPU),
    and a TorchTPU name torch_pjrt lacks raises AttributeError with the reason."""

    @property
    def eager_mode(self) -> EagerMode:
        """The calling thread's mode (torch_pjrt.get_mode()); setting it sets the process's (set_mode())."""
        import torch_pjrt

        return EagerMode(torch_pjrt.get_mode())

    @eager_mode.setter
    def eager_mode(self, value) -> None:
        import torch_pjrt

        torch_pjrt.set_mode(_mode_name(value))

    @property
    def default_generators(self) -> tuple:
        """Each device's default torch.Generator, as torch.cuda.default_generators: seeding one is
        torch.tpu.manual_seed on that device."""
        gens = self.__dict__.get("_default_generators")
        if gens is None:
            from .. import _C

            gens = tuple(_C._default_generator(i) for i in range(_C._device_count()))
            self.__dict__["_default_generators"] = gens
        return gens

    def __getattr__(self, name: str):
        absent = self.__dict__.get("_absent_getattr")
        if absent is None:
            raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}")
        return absent(name)


def install(module: types.ModuleType) -> None:
    if not isinstance(module, _TpuModule):
        module.__class__ = _TpuModule
    for name, value in (("EagerMode", EagerMode), ("set_eager_mode", set_eager_mode), ("Precision", Precision),
                        ("precision", precision), ("device_of", device_of),
                        ("topology_aware_mesh", topology_aware_mesh)):
        setattr(module, name, value)
