"""transformers' continuous batching on tpu: its paged cache is sized from the device's memory.

transformers sizes the cache from `get_device_and_memory_breakdown()`, which knows CUDA, XPU and MPS; any other
device is taken for the CPU and gets the host's *total* RAM less the process's resident size, so a `tpu` model
asked for a cache of most of the machine (on the CPU plugin, device memory is host memory: the kernel killed the
process). A cache made for a `tpu` model now asks `torch.tpu.mem_get_info` instead: free and total device memory
(on the CPU plugin, the host's available and total memory), as the CUDA branch does with `torch.cuda.mem_get_info`.
`ContinuousBatchingConfig(num_blocks=..., max_memory_percent=...)` still overrides the sizing."""
import threading

import torch

from .._after_import import after_import

_CACHE_MODULE = "transformers.generation.continuous_batching.cache"
_sizing_for = threading.local()  # the device of the cache being made on this thread


def tpu_memory_breakdown(device) -> tuple:
    """(device, total, reserved, allocated) bytes, as transformers' breakdown gives for CUDA."""
    torch.tpu.synchronize(device)
    free, total = torch.tpu.mem_get_info(device)
    return torch.device(device), total, torch.tpu.memory_reserved(device), total - free


def _patch(cache_module) -> None:
    original_breakdown = cache_module.get_device_and_memory_breakdown
    cache_class = cache_module.PagedAttentionCache
    original_init = cache_class.__init__
    if getattr(original_init, "_torch_pjrt", False):
        return

    def breakdown():
        device = getattr(_sizing_for, "device", None)
        return tpu_memory_breakdown(device) if device is not None else original_breakdown()

    def __init__(self, config, continuous_batching_config, device, *args, **kwargs):
        device_type = torch.device(device).type if isinstance(device, (str, torch.device)) else None
        _sizing_for.device = torch.device(device) if device_type == "tpu" else None
        try:
            original_init(self, config, continuous_batching_config, device, *args, **kwargs)
        finally:
            _sizing_for.device = None

    __init__._torch_pjrt = True
    cache_module.get_device_and_memory_breakdown = breakdown
    cache_class.__init__ = __init__


def install() -> None:
    after_import(_CACHE_MODULE, _patch)
