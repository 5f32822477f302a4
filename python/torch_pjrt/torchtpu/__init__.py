"""TorchTPU's `torch.tpu` API on torch_pjrt: code written for Google's TorchTPU (`torch-tpu`) runs here too.

TorchTPU and torch_pjrt both name their device `tpu` and their device module `torch.tpu`. `install()` adds
the TorchTPU 0.2.0 names that torch_pjrt can honour:

- on `torch.tpu`: `EagerMode`, `eager_mode` (a settable attribute), `set_eager_mode`, `Precision`,
  `precision`, `device_of`, `topology_aware_mesh` (deprecated alias, as in TorchTPU);
- the submodules `torch.tpu.pallas`, `torch.tpu.ops`, `torch.tpu.distributed`, `torch.tpu.profiler`,
  `torch.tpu.compiler` and `torch.tpu.optimizers`, importable as `import torch.tpu.pallas`.

A TorchTPU name that is not provided raises AttributeError saying why (hardware-only, or not built yet).
docs/torchtpu-compat.md has the table of every TorchTPU public name and its status here.
"""
from __future__ import annotations

import sys
import types

# TorchTPU names this package does not provide, with the reason (AttributeError says it).
ABSENT = {
    "torch.tpu": {
        "allow_excess_precision": "XLA's --xla_allow_excess_precision is not settable per process here: torch_pjrt "
                                  "passes no XLA debug options from Python (the extension would need a binding)",
    },
    "torch.tpu.pallas": {
        "get_pallas_mesh": "jax_op runs a kernel on one device: meshes and partition specs are not supported",
    },
    "torch.tpu.ops": {
        "sparse_map_row": "its body is an MLIR module compiled for the SparseCore's own dialect (tpu/sparse "
                          "ops on CSR tiles): it cannot be run portably on other devices",
        "align_jagged_to_multiple": "not built yet: jagged NestedTensors are not supported on tpu",
        "strip_jagged_padding": "not built yet: jagged NestedTensors are not supported on tpu",
    },
    "torch.tpu.compiler": {
        "custom_compiler_options": "not built yet: torch_pjrt sets no per-scope XLA compiler options from Python",
    },
    "torch.tpu.distributed": {
        "set_tpu_launch_env": "TPU slice bootstrap (SliceBuilder addresses, physical topology): torchrun's "
                              "environment is all tpu_dist needs",
        "window_num_stripes": "TPU DMA tuning of TorchTPU's own peer transfers: tpu_dist has no such transfers",
        "window_stripe_chunk_mb": "TPU DMA tuning of TorchTPU's own peer transfers: tpu_dist has no such transfers",
    },
    "torch.tpu.optimizers": {
        name: "not built yet: TorchTPU's functional (ParamGroup) optimizers; torch.optim's optimizers run on tpu"
        for name in ("AdamW", "Muon", "Optimizer", "Sgd")
    },
}
ABSENT["torch.tpu.optimizers"]["SingleTraceTrainer"] = (
    "not built yet: torch.compile(backend='tpu') of the train step, or fused mode (one graph per optimizer step)")


def _absent_getattr(module_name: str):
    def __getattr__(name: str):
        reason = ABSENT.get(module_name, {}).get(name)
        if reason is not None:
            raise AttributeError(f"{module_name}.{name} (TorchTPU) is not provided by torch_pjrt: {reason}. "
                                 "See docs/torchtpu-compat.md.")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def _submodule(name: str, source: types.ModuleType | None) -> types.ModuleType:
    """`torch.tpu.<name>`: the module `source` (its public names), registered in sys.modules."""
    full = f"torch.tpu.{name}"
    module = types.ModuleType(full, source.__doc__ if source is not None else f"TorchTPU's {full} (nothing here yet).")
    if source is not None:
        for attr in source.__all__:
            setattr(module, attr, getattr(source, attr))
        module.__all__ = list(source.__all__)
    else:
        module.__all__ = []
    module.__getattr__ = _absent_getattr(full)
    sys.modules[full] = module
    return module


def install() -> None:
    """Adds TorchTPU's names to torch.tpu (torch_pjrt's device module) and its submodules. Idempotent."""
    from .. import device_module
    from . import _device, distributed, ops, pallas, profiler

    _device.install(device_module)
    for name, source in (("pallas", pallas), ("ops", ops), ("distributed", distributed), ("profiler", profiler),
                         ("compiler", None), ("optimizers", None)):
        setattr(device_module, name, _submodule(name, source))
    device_module._absent_getattr = _absent_getattr("torch.tpu")
