"""torch.compile on tpu: registers the 'tpu' backend, and sends tpu graphs that reach Inductor to it."""
from __future__ import annotations

import functools

import torch

from . import _C
from ._compile_backend import BACKEND, tpu_backend
from ._flex_attention import allow_flex_attention
from ._source_lines import source_line


def _register_now() -> None:
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    _route_inductor_late()
    # An installed package declares `tpu` in Dynamo's entry-point group: the registry loads that entry point
    # itself (and would find this name taken if this import, which its load runs, registered it first).
    if BACKEND not in _COMPILER_FNS and not isinstance(_BACKENDS.get(BACKEND), EntryPoint):
        register_backend(name=BACKEND)(tpu_backend)


# ---- the default backend (Inductor) on tpu ----------------------------------
# torch 2.13's Inductor takes device `tpu` for Google's TorchTPU and generates
# Pallas kernels that call into the torch_tpu package. A graph that touches a
# tpu tensor therefore goes to this backend instead, wherever Inductor is
# entered: torch.compile's default (the Inductor wrapper object), the registry's
# "inductor" name and compile_fx itself. Inductor's options and modes were
# checked by torch.compile already and mean nothing here: the graph is one XLA
# program either way (reduce-overhead's CUDA graphs are what replay does).
# Graphs without a tpu tensor reach Inductor unchanged.


def _touches_device(gm, example_inputs) -> bool:
    """A graph with a tpu tensor among its inputs or the values it computes (a factory with device='tpu')."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == BACKEND:
            return True
    for node in gm.graph.nodes:
        for key in ("example_value", "val"):
            vals = node.meta.get(key)
            for v in vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(v, torch.Tensor) and v.device.type == BACKEND:
                    return True
    return False


def _routed(inductor_entry):
    """inductor_entry(gm, example_inputs, ...), with graphs on tpu sent to tpu_backend."""
    if getattr(inductor_entry, "_torch_pjrt_routed", False):
        return inductor_entry

    @functools.wraps(inductor_entry)
    def entry(*args, **kwargs):
        # (self,) gm, example_inputs: the wrapper class's __call__ gets its instance first
        rest = args[1:] if args and not isinstance(args[0], torch.fx.GraphModule) else args
        gm = rest[0] if rest else kwargs.get("model_")
        example_inputs = rest[1] if len(rest) > 1 else kwargs.get("inputs_", kwargs.get("example_inputs_", ()))
        if isinstance(gm, torch.fx.GraphModule) and _touches_device(gm, example_inputs):
            _routed_graphs[0] += 1
            return tpu_backend(gm, example_inputs)
        return inductor_entry(*args, **kwargs)

    entry._torch_pjrt_routed = True
    return entry


_routed_graphs = [0]  # graphs torch.compile's Inductor path sent to this backend (tests read it)


def route_inductor() -> None:
    """Sends tpu graphs that reach Inductor to this backend (cheap: no Inductor import)."""
    wrapper = torch._TorchCompileInductorWrapper
    wrapper.__call__ = _routed(wrapper.__call__)


def _route_inductor_late() -> None:
    """The entries that exist once torch._dynamo is imported: the registry's "inductor", registered when the
    registry first imports its backends (wrapped then: importing them all costs seconds), and compile_fx when
    torch._inductor.compile_fx is imported already (the registry's entry imports it at call time)."""
    import sys

    from torch._dynamo.backends import registry

    lazy_import = registry._lazy_import
    if not getattr(lazy_import, "_torch_pjrt_routed", False):
        def _lazy_import():
            lazy_import()
            if "inductor" in registry._COMPILER_FNS:
                registry._COMPILER_FNS["inductor"] = _routed(registry._COMPILER_FNS["inductor"])

        _lazy_import._torch_pjrt_routed = True
        registry._lazy_import = _lazy_import
    if "inductor" in registry._COMPILER_FNS:  # imported already
        registry._COMPILER_FNS["inductor"] = _routed(registry._COMPILER_FNS["inductor"])
    module = sys.modules.get("torch._inductor.compile_fx")
    if module is not None:
        module.compile_fx = _routed(module.compile_fx)


def register() -> None:
    """Registers the backend; importing torch._dynamo costs ~1 s, so only when it is needed.

    If torch._dynamo is loaded already, now; otherwise at the first torch.compile call.
    """
    import sys

    _C._set_generated_code_resolver(source_line)
    route_inductor()
    allow_flex_attention()
    if "torch._dynamo" in sys.modules:
        _register_now()
        return
    original = torch.compile
    if getattr(original, "_torch_pjrt_wrapped", False):
        return

    @functools.wraps(original)
    def compile(*args, **kwargs):
        _register_now()
        return original(*args, **kwargs)

    compile._torch_pjrt_wrapped = True
    torch.compile = compile
