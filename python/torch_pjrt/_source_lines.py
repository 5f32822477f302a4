"""Errors name the user's line: FX runs a compiled graph as generated code (file "<eval_with_key>.N"). The
source location hook asks source_line() for such frames: the generated line's node carries the stack trace of
the user's line that Dynamo traced."""
from __future__ import annotations

import weakref

_graph_sources = weakref.WeakValueDictionary()  # generated file name -> GraphModule


def note_graph_source(gm) -> None:
    if getattr(gm, "_needs_recompile", lambda: False)():
        gm.real_recompile()  # a lazy graph module has its generated code only now
    code = getattr(type(gm).forward, "__code__", None)
    if code is not None and code.co_filename.startswith("<eval_with_key>"):
        _graph_sources[code.co_filename] = gm


def source_line(filename: str, line: int):
    """'file:line in function' of the user's code behind a generated FX line, or None."""
    gm = _graph_sources.get(filename)
    if gm is None:
        return None
    lineno_map = getattr(gm, "_lineno_map", None) or {}
    prologue = getattr(gm, "_prologue_start", 0)
    index = lineno_map.get(line - prologue)
    if index is None:
        return None
    nodes = list(gm.graph.nodes)
    if index >= len(nodes):
        return None
    trace = nodes[index].meta.get("stack_trace") or ""
    frames = [l.strip() for l in trace.splitlines() if l.strip().startswith("File ")]
    if not frames:
        return None
    # 'File "x.py", line 12, in forward' -> 'x.py:12 in forward'
    parts = frames[-1].split(", ")
    try:
        path = parts[0][len('File "'):-1]
        number = parts[1][len("line "):]
        where = parts[2][len("in "):] if len(parts) > 2 else "?"
    except IndexError:
        return None
    return f"{path}:{number} in {where} (compiled graph)"
