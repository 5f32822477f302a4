"""A torch.export program's graph recorded on tpu as one torch_pjrt program, and that program's map to the
graph's inputs and outputs (docs/design/export.md).

The graph runs in fused mode inside one compiled-call scope, so its ops are one pending graph, as a
torch.compile graph's are; the extension then gives the pending graph's program text and, per program
parameter, the input storage or the constant it reads. That last step needs the extension binding
`_C._export_program` (specified in docs/design/export.md); without it save() raises NotImplementedError.
"""
from __future__ import annotations

import torch

from .. import _C
from . import _module

MISSING_BINDING = (
    "torch_pjrt.export.save needs the extension binding _C._export_program(inputs, outputs), which this build "
    "lacks: it gives the recorded graph's program text and which input storage or constant each program "
    "parameter reads (the replay plan's operand map; docs/design/export.md, 'The binding save needs'). "
    "torch_pjrt.export.load and from_jax work without it.")


def binding():
    return getattr(_C, "_export_program", None)


def program_from_binding(info) -> _module.Program:
    """The binding's answer as a Program. info: {"text": str, "operands": [("input", i) | ("constant", dtype
    name, dims, bytes) | ("rng", count)], "checks": int, "outputs": [(source, index, sizes, strides, offset)]}."""
    operands = []
    for op in info["operands"]:
        if op[0] == "constant":
            operands.append(("constant", _module.dtype_of(op[1]), tuple(op[2]), bytes(op[3])))
        else:
            operands.append(tuple(op))
    outputs = [(o[0], int(o[1]), tuple(o[2]), tuple(o[3]), int(o[4])) for o in info["outputs"]]
    return _module.Program(info["text"], operands, int(info.get("checks", 0)), outputs)


def record(graph_module, inputs):
    """(the Program of graph_module run on the tpu tensors `inputs`, its outputs as computed): each output is
    copied to a storage of its own, so every output is a whole contiguous program result."""
    from .._compile_backend import _OneProgram

    export_program = binding()
    if export_program is None:
        raise NotImplementedError(MISSING_BINDING)
    with torch.no_grad(), _OneProgram(alone=True):
        outs = graph_module(*inputs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise NotImplementedError(f"torch_pjrt.export: output {i} is a {type(o).__name__}, not a tensor")
        outs = [o.clone(memory_format=torch.contiguous_format) for o in outs]
        info = export_program(list(inputs), outs)
        if info is None:
            raise RuntimeError("torch_pjrt.export: the graph is not one portable program: " + _C._replay_refusal())
    return program_from_binding(info), outs
