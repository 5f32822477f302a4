"""A torch.export program's graph recorded on tpu as one torch_pjrt program, and that program's map to the
graph's inputs and outputs (docs/design/export.md).

The graph runs in fused mode inside one compiled-call scope, so its ops are one pending graph, as a
torch.compile graph's are; the extension then gives the pending graph's program text and, per program
parameter, the input storage or the constant it reads (`_C._export_program`, docs/design/export.md).
"""
from __future__ import annotations

import torch

from .. import _C
from . import _module

def program_from_binding(info) -> _module.Program:
    """The binding's answer as a Program. info: {"text": str, "operands": [("input", i) | ("constant", torch
    dtype, dims, bytes) | ("rng", count)], "checks": int, "outputs": [(source, index, sizes, strides, offset)]}."""
    operands = []
    for op in info["operands"]:
        if op[0] == "constant":
            operands.append(("constant", op[1], tuple(op[2]), bytes(op[3])))
        else:
            operands.append(tuple(op))
    outputs = [(o[0], int(o[1]), tuple(o[2]), tuple(o[3]), int(o[4])) for o in info["outputs"]]
    return _module.Program(info["text"], operands, int(info.get("checks", 0)), outputs)


def _own_outputs(outs):
    """Each output copied to a whole contiguous storage of its own; the graph's own results are dropped here
    (a result still referenced would be a program result that is neither an input nor an output)."""
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for i, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            raise NotImplementedError(f"torch_pjrt.export: output {i} is a {type(o).__name__}, not a tensor")
    return [o.clone(memory_format=torch.contiguous_format) for o in outs]


def record(graph_module, inputs):
    """(the Program of graph_module run on the tpu tensors `inputs`, its outputs as computed): each output is
    copied to a storage of its own, so every output is a whole contiguous program result."""
    from .._compile_backend import _OneProgram

    with torch.no_grad(), _OneProgram(alone=True):
        outs = _own_outputs(graph_module(*inputs))  # nothing else may hold a result the program writes
        info = _C._export_program(list(inputs), outs)
        if info is None:
            raise RuntimeError("torch_pjrt.export: the graph is not one portable program: " + _C._replay_refusal())
    return program_from_binding(info), outs
