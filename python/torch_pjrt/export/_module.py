"""StableHLO module text: the exported module's public main around torch_pjrt's program, and the renaming that
lets torch_pjrt call a module's main from its own programs (docs/design/export.md)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

# torch dtype -> MLIR element type
_ELEMENT = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
            torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "ui8",
            torch.bool: "i1", torch.complex64: "complex<f32>", torch.complex128: "complex<f64>"}
_DTYPE = {v: k for k, v in _ELEMENT.items()}
# names the manifest uses (torch's, without the prefix)
_BY_NAME = {str(d).removeprefix("torch."): d for d in _ELEMENT}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ValueError(f"torch_pjrt.export: unsupported dtype {name!r}")
    return _BY_NAME[name]


def tensor_type(shape, dtype: torch.dtype) -> str:
    if dtype not in _ELEMENT:
        raise TypeError(f"torch_pjrt.export: dtype {dtype} has no StableHLO element type here")
    dims = "".join(f"{int(d)}x" for d in shape)
    return f"tensor<{dims}{_ELEMENT[dtype]}>"


def parse_tensor_type(text: str):
    """(shape, torch dtype) of 'tensor<2x3xf32>'."""
    inner = text.strip()[len("tensor<"):-1]
    parts = []
    depth, start = 0, 0
    for i, ch in enumerate(inner):  # split on 'x' outside complex<...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "x" and depth == 0 and inner[start:i].isdigit():
            parts.append(inner[start:i])
            start = i + 1
    element = inner[start:]
    if element not in _DTYPE:
        raise ValueError(f"torch_pjrt.export: unsupported element type in {text}")
    return tuple(int(p) for p in parts), _DTYPE[element]


def types_in(text: str) -> list:
    """Every tensor<...> type in text, in order (angle brackets balanced: complex<f32> nests)."""
    types, i = [], 0
    while True:
        i = text.find("tensor<", i)
        if i < 0:
            return types
        depth, j = 0, i + len("tensor")
        while True:
            if text[j] == "<":
                depth += 1
            elif text[j] == ">":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        types.append(text[i:j + 1])
        i = j + 1


def module_body(text: str) -> str:
    """The operations inside a printed module's top-level `module ... {` ... `}`, locations dropped."""
    text = strip_locations(text)
    start = text.find("module")
    if start < 0:
        raise ValueError("torch_pjrt.export: the text holds no module")
    header_end = text.index("\n", start)
    if not text[:header_end].rstrip().endswith("{"):
        raise ValueError("torch_pjrt.export: unexpected module header: " + text[start:header_end])
    end = text.rindex("}")
    return text[header_end + 1:end]


_LOCATION = re.compile(r"\s+loc\((?:#[\w.$-]+|unknown)\)")


def strip_locations(text: str) -> str:
    """torch_pjrt's programs end each op with loc(#opN) and define the aliases after the module: drop both (the
    aliases name the user's source files, which mean nothing where the module is loaded)."""
    text = _LOCATION.sub("", text)
    lines = [line for line in text.split("\n") if not re.match(r"\s*#[\w.$-]+ = loc\(", line)]
    return "\n".join(line for line in lines if line.strip() != "// torch_pjrt op locations")


def main_signature(body: str):
    """([parameter types], [result types]) of the pretty-printed `func.func ... @main(...) -> ...` in body."""
    m = re.search(r"func\.func\s+(?:(?:public|private)\s+)?@main\(", body)
    if m is None:
        raise ValueError("torch_pjrt.export: no pretty-printed main function in the program")
    i, depth = m.end(), 1
    while depth:
        depth += {"(": 1, ")": -1}.get(body[i], 0)
        i += 1
    params = types_in(body[m.end():i - 1])
    brace = body.index("{", i)
    results = types_in(body[i:brace])
    return params, results


# ---- the exported module -------------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """torch_pjrt's program of a recorded graph, and how it maps to the graph's inputs and outputs.

    text: the program module, as torch_pjrt compiles it (pretty `func.func public @main`, generic ops).
    operands: per program parameter, ("input", i): the graph input i's storage (flat), or
        ("constant", dtype, shape, data: bytes): a value fixed at export (a Scalar, a view's offset).
    checks: trailing results that are runtime-check statuses (dropped).
    outputs: per graph output, (source, index, shape, stride, offset): a view of program result `index`
        ("result") or of graph input `index` ("input") in its flat storage.
    """

    text: str
    operands: list
    checks: int
    outputs: list


def constant_literal(dtype: torch.dtype, shape, data: bytes) -> str:
    """A dense attribute holding data (little-endian raw values) as a tensor of dtype and shape."""
    array = np.frombuffer(data, dtype=np.uint8)
    count = int(np.prod(shape)) if len(shape) else 1
    if dtype == torch.bool:
        values = ["true" if b else "false" for b in array[:count]]
        return f"dense<{values[0]}>" if len(set(values)) == 1 else "dense<[" + ", ".join(values) + "]>"
    if count == 1 and not dtype.is_complex:
        if dtype.is_floating_point:  # the bit pattern, as torch_pjrt's own constants: exact for every float
            return "dense<0x" + data[::-1].hex().upper() + ">"
        value = int.from_bytes(data, "little", signed=dtype != torch.uint8)
        return f"dense<{value}>"
    return 'dense<"0x' + data.hex().upper() + '">'


def _view_of(lines, counter, source, flat_type, numel, dtype, shape, stride, offset):
    """Ops reading a contiguous view (shape, offset) of the flat value `source`; returns its value name."""
    contiguous = list(torch.empty(shape, device="meta").stride()) if len(shape) else []
    if [s for d, s in zip(shape, stride) if d != 1] != [s for d, s in zip(shape, contiguous) if d != 1]:
        raise NotImplementedError("torch_pjrt.export: an output that is not a contiguous view of its storage")
    count = int(np.prod(shape)) if len(shape) else 1
    value, value_type = source, flat_type
    if offset != 0 or count != numel:
        name = f"%v{next(counter)}"
        sliced = tensor_type([count], dtype)
        lines.append(f'    {name} = "stablehlo.slice"({value}) {{start_indices = array<i64: {offset}>, '
                     f'limit_indices = array<i64: {offset + count}>, strides = array<i64: 1>}} : '
                     f'({value_type}) -> {sliced}')
        value, value_type = name, sliced
    out_type = tensor_type(shape, dtype)
    if value_type != out_type:
        name = f"%v{next(counter)}"
        lines.append(f'    {name} = "stablehlo.reshape"({value}) : ({value_type}) -> {out_type}')
        value = name
    return value


def assemble(program: Program, inputs, outputs) -> str:
    """The exported module: a public main taking the graph's inputs (weights first, as the graph's
    placeholders) in their own shapes and returning its outputs, calling torch_pjrt's program, which
    takes flat storages and constants.

    inputs, outputs: [(shape, dtype)] of the graph's inputs and outputs.
    """
    import itertools

    body = module_body(program.text)
    params, results = main_signature(body)
    if len(params) != len(program.operands):
        raise ValueError(f"torch_pjrt.export: the program takes {len(params)} parameters, the map names "
                         f"{len(program.operands)}")
    inner = body.replace("func.func public @main(", "func.func private @program(", 1)
    if "@program(" not in inner:
        raise ValueError("torch_pjrt.export: the program's main is not public")
    counter = itertools.count()
    lines = []
    arg_types = [tensor_type(s, d) for s, d in inputs]
    flat = {}  # input index -> (flat value, its type, its element count)

    def flat_input(i, want=None):
        shape, dtype = inputs[i]
        numel = int(np.prod(shape)) if len(shape) else 1
        want = want or tensor_type([numel], dtype)
        key = (i, want)
        if key not in flat:
            if arg_types[i] == want:
                flat[key] = f"%arg{i}"
            else:
                name = f"%v{next(counter)}"
                lines.append(f'    {name} = "stablehlo.reshape"(%arg{i}) : ({arg_types[i]}) -> {want}')
                flat[key] = name
        return flat[key], want, numel

    operands = []
    for k, (operand, param_type) in enumerate(zip(program.operands, params)):
        if operand[0] == "input":
            i = operand[1]
            p_shape, p_dtype = parse_tensor_type(param_type)
            shape, dtype = inputs[i]
            numel = int(np.prod(shape)) if len(shape) else 1
            p_numel = int(np.prod(p_shape)) if len(p_shape) else 1
            if p_dtype != dtype or p_numel != numel:
                raise ValueError(f"torch_pjrt.export: program parameter {k} is {param_type}, its input {i} is "
                                 f"{tensor_type(shape, dtype)} (an input that is not a whole contiguous storage)")
            operands.append(flat_input(i, param_type)[0])
        elif operand[0] == "constant":
            _, dtype, shape, data = operand
            p_shape, p_dtype = parse_tensor_type(param_type)
            if p_dtype != dtype or int(np.prod(p_shape)) != int(np.prod(shape)):
                raise ValueError(f"torch_pjrt.export: constant parameter {k} is {param_type}, the map gives "
                                 f"{tensor_type(shape, dtype)}")
            name = f"%v{next(counter)}"
            lines.append(f'    {name} = "stablehlo.constant"() {{value = '
                         f'{constant_literal(dtype, parse_tensor_type(param_type)[0], data)} : {param_type}}} : '
                         f'() -> {param_type}')
            operands.append(name)
        else:
            raise ValueError(f"torch_pjrt.export: program parameter {k} is {operand[0]!r}, which a portable "
                             "program cannot take (a random state is drawn per call)")
    call = f"%v{next(counter)}"
    many = len(results) > 1
    lines.append(f'    {call}{":" + str(len(results)) if many else ""} = "func.call"({", ".join(operands)}) '
                 f'{{callee = @program}} : ({", ".join(params)}) -> ({", ".join(results)})')
    result_values = [f"{call}#{k}" if many else call for k in range(len(results))]
    returned = []
    for j, (source, index, shape, stride, offset) in enumerate(program.outputs):
        shape_j, dtype_j = outputs[j]
        if tuple(shape) != tuple(shape_j):
            raise ValueError(f"torch_pjrt.export: output {j} has shape {list(shape)}, the graph says {list(shape_j)}")
        if source == "result":
            r_shape, r_dtype = parse_tensor_type(results[index])
            numel = int(np.prod(r_shape)) if len(r_shape) else 1
            if r_dtype != dtype_j:
                raise ValueError(f"torch_pjrt.export: output {j} is {dtype_j}, its program result {results[index]}")
            value = _view_of(lines, counter, result_values[index], results[index], numel, dtype_j, shape, stride,
                             offset)
        else:
            value_flat, flat_type, numel = flat_input(index)
            value = _view_of(lines, counter, value_flat, flat_type, numel, dtype_j, shape, stride, offset)
        returned.append(value)
    out_types = [tensor_type(s, d) for s, d in outputs]
    signature = ", ".join(f"%arg{i}: {t}" for i, t in enumerate(arg_types))
    head = f"  func.func public @main({signature}) -> ({', '.join(out_types)}) {{"
    tail = f'    "func.return"({", ".join(returned)}) : ({", ".join(out_types)}) -> ()\n  }}'
    return "module @torch_pjrt_export {\n" + "\n".join([head] + lines + [tail]) + "\n" + inner.rstrip() + "\n}\n"
