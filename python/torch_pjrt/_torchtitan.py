"""TorchTitan on `tpu`: what torchtitan needs that is not a device feature.

torchtitan finds the device itself (`torch._utils._get_available_device_type()`, the PrivateUse1 backend once
torch_pjrt is imported) and uses `torch.tpu` as its device module; everything it asks of the device is in
torch_pjrt proper. One thing is not: torchtitan 0.3 imports Triton unconditionally,

    torchtitan.models.common.decoder -> .moe -> .token_dispatcher
        -> torchtitan.distributed.minimal_async_ep.kernels: `import triton`

for the CUDA symmetric-memory kernels of its expert-parallel token dispatcher (`MinimalAsyncEP`), which a dense
Llama never runs and which cannot run on tpu anyway. CPU PyTorch wheels do not bring Triton, so `import
torchtitan.train` fails before anything starts. When `triton` is not installed, this module supplies that one
module as a placeholder whose kernels raise an error naming Triton if called; with Triton installed (`pip install
triton`, ~1 GB) nothing is replaced.

And torchtitan 0.3 calls `torch.distributed.set_timeout(timeout, group)` after its first step, a function newer
than torch 2.13 (on any device: CUDA too). torch 2.13 has the same operation as the method
`ProcessGroup.set_timeout`, which sets every backend of the group (Gloo and `tpu_dist` alike); when torchtitan is
imported and the function is missing, `torch.distributed.set_timeout` is defined to call it.

Nothing here imports torchtitan: a finder on sys.meta_path acts when (and if) torchtitan is imported. See
docs/torchtitan.md.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
# The names torchtitan.distributed.minimal_async_ep.api imports from it (torchtitan 0.3.0).
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"torchtitan's {name} is a Triton kernel (MinimalAsyncEP, CUDA expert parallelism) and Triton is not "
            "installed; torch_pjrt let torchtitan import without it because dense models never call it. "
            "Use another expert-parallel dispatcher on tpu.")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


class _PlaceholderLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.__doc__ = ("Placeholder from torch_pjrt._torchtitan: Triton is not installed, so torchtitan's "
                          "MinimalAsyncEP Triton kernels are unavailable (calling one raises).")
        module.__torch_pjrt_placeholder__ = True
        for name in _KERNEL_NAMES:
            setattr(module, name, _unavailable(name))

        def __getattr__(attr):  # any other kernel a later torchtitan adds: fail where it is used, not at import
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _unavailable(attr)

        module.__getattr__ = __getattr__


def _add_set_timeout() -> None:
    """torch.distributed.set_timeout(timeout, group=None) where torch lacks it (2.13): the ProcessGroup method."""
    import torch.distributed as dist

    if not dist.is_available() or hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout, group=None):
        """Sets the default timeout of every backend of `group` (the default group when None) for later work."""
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        group.set_timeout(timeout)

    set_timeout._torch_pjrt_compat = True
    dist.set_timeout = set_timeout


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchtitan":
            _add_set_timeout()  # before any torchtitan code runs; the finder then defers to the others
            return None
        if name != _KERNELS or _triton_installed():
            return None
        return importlib.machinery.ModuleSpec(name, _PlaceholderLoader(), origin="torch_pjrt placeholder")


def install() -> None:
    """Adds the finder (once); with torchtitan already imported, adds set_timeout now."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if "torchtitan" in sys.modules:
        _add_set_timeout()
