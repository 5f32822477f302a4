"""Running a StableHLO module on tpu: its functions are registered with the extension, as jax_op registers a
JAX kernel, and torch_pjrt::jax_call calls its main, so the module runs as one op (fused with the ops around
it in fused and compiled mode) with no model code (docs/design/export.md)."""
from __future__ import annotations

import hashlib

import torch

from .. import _C
from .. import _jax
from . import _module


class ModuleFunction:
    """A StableHLO module's main as a function of tpu tensors.

    inputs, outputs: [(shape, torch dtype)] of main's parameters and results, which the module text must
    declare (a mismatch fails the program's compile).
    """

    def __init__(self, text: str, inputs, outputs, cpu_fn=None):
        self.inputs = [(tuple(s), d) for s, d in inputs]
        self.outputs = [(tuple(s), d) for s, d in outputs]
        self.key = "export_" + hashlib.sha1(text.encode()).hexdigest()[:16]
        symbol, definitions = _jax._private_functions(_module.module_body(text), self.key + "_", "torch_pjrt.export")
        _jax._define_jax_call()
        _C._register_external_function(self.key, symbol, definitions, "")
        with _jax._lock:
            # The op's meta kernel reads the results' types here; its CPU kernel (CPU tensor arguments) runs
            # cpu_fn, a function of JAX arrays (None: CPU arguments raise).
            _jax._modules[self.key] = _jax._Lowered(cpu_fn or _no_cpu, self.outputs)

    def check(self, tensors):
        if len(tensors) != len(self.inputs):
            raise TypeError(f"torch_pjrt.export: the program takes {len(self.inputs)} tensors, got {len(tensors)}")
        for i, (t, (shape, dtype)) in enumerate(zip(tensors, self.inputs)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"torch_pjrt.export: argument {i} is {type(t).__name__}, not a tensor")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise TypeError(f"torch_pjrt.export: argument {i} is {t.dtype}{list(t.shape)}, the program was "
                                f"exported for {dtype}{list(shape)} (programs have static shapes: export again "
                                "for other sizes)")

    def __call__(self, tensors):
        self.check(tensors)
        return list(torch.ops.torch_pjrt.jax_call(list(tensors), self.key))


def _no_cpu(*args):
    raise RuntimeError("torch_pjrt.export: this program runs on tpu tensors (LoadedProgram.jax_exported() runs it "
                       "with JAX)")
