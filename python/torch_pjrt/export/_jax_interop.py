"""JAX's side of an exported module: StableHLO's versioned portable artifact (VHLO bytecode), the module text
of a bytecode artifact, and a jax.export.Exported that JAX runs (and serializes) without torch.

jax is optional: only these functions import it. Two of its calls are internal (jax 0.10.2): the
serializer that also legalizes CHLO ops (torch_pjrt's programs hold chlo.erf and others, which StableHLO's
public serializer refuses) and JAX's MLIR context (the dialects registered).
"""
from __future__ import annotations

import dataclasses

import torch


def available() -> bool:
    try:
        import jax  # noqa: F401
        return True
    except ImportError:
        return False


def _torch_to_jax(dtype):
    from .._jax import _torch_dtype_to_jax

    return _torch_dtype_to_jax(dtype)


def portable_artifact(text: str):
    """(VHLO bytecode of the module text, its StableHLO target version): consumers with a StableHLO at least
    that old and within StableHLO's compatibility window can read it. The target is the version 12 weeks old
    (JAX's own exports use 4 weeks), the current one if the module needs newer ops."""
    from jax._src.lib import _jax
    from jax._src.lib.mlir.dialects import hlo

    errors = []
    for requirement in (hlo.StablehloCompatibilityRequirement.WEEK_12, hlo.StablehloCompatibilityRequirement.NONE):
        target = hlo.get_version_from_compatibility_requirement(requirement)
        try:
            return _jax.mlir.serialize_portable_artifact(text, target, False), str(target)
        except Exception as e:  # an op newer than the target
            errors.append(f"{target}: {e}")
    raise RuntimeError("torch_pjrt.export: StableHLO could not serialize the module: " + "; ".join(errors))


def module_text(artifact: bytes) -> str:
    """The StableHLO text (no locations) of a portable artifact."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir.dialects import stablehlo

    with jax_mlir.make_ir_context() as context:
        module = stablehlo.deserialize_portable_artifact(context, artifact)
        return module.operation.get_asm(enable_debug_info=False)


def exported(artifact: bytes, inputs, outputs, platform: str, name: str = "torch_pjrt_export"):
    """A jax.export.Exported running the module: its main takes `inputs` and returns `outputs` ([(shape, torch
    dtype)]), positionally; lowered for `platform` ("cpu", "cuda" or "tpu")."""
    import jax
    import jax.numpy as jnp
    from jax import export

    in_avals = [jax.ShapeDtypeStruct(tuple(s), _torch_to_jax(d)) for s, d in inputs]
    out_avals = [(tuple(s), _torch_to_jax(d)) for s, d in outputs]

    def stand_in(*args):  # only its signature is kept: the module replaces its lowering
        return tuple(jnp.zeros(s, d) for s, d in out_avals)

    template = export.export(jax.jit(stand_in), platforms=[platform])(*in_avals)
    changes = dict(fun_name=name, mlir_module_serialized=artifact, module_kept_var_idx=tuple(range(len(inputs))))
    fields = {f.name for f in dataclasses.fields(template)}
    if "_get_vjp" in fields:
        changes["_get_vjp"] = None  # the stand-in's derivative is not the module's
    return dataclasses.replace(template, **changes)


def serialized(exp) -> bytes | None:
    """exp.serialize() (jax.export.deserialize reads it), or None where JAX lacks its serializer (flatbuffers)."""
    try:
        return bytes(exp.serialize())
    except ImportError:
        return None


def to_numpy(t: torch.Tensor):
    from .._jax import _to_numpy

    return _to_numpy(t.detach().cpu())


def from_jax_array(a) -> torch.Tensor:
    from .._jax import _from_numpy

    return _from_numpy(a)
