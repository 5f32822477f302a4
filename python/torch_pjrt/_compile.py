"""torch.compile(model, backend="tpu"): Dynamo graphs as single fused XLA programs.

Dynamo captures a graph, AOTAutograd splits it into a forward and a backward
ATen graph (functionalized; PyTorch's core ATen decompositions only for ops we
have no lowering for). Each graph then runs its ATen nodes on the device in
fused mode and the graph is cut at its end: the nodes are lowered by exactly
the lowerings eager mode uses, and the whole graph is one XLA program, found
again by the fused graph cache on every later call with the same shapes.
Dynamo's guards keep a compiled graph's op sequence fixed, so a repeated call
recompiles nothing (neither in Dynamo nor in XLA), and later calls replay the
captured program directly without dispatching its ops (_CompiledGraph).

Graph breaks run in the current mode (fused by default) between the compiled
pieces. Dynamic shapes (dynamic=True, mark_dynamic): Dynamo keeps one graph
whose size arguments are ints at run time; each distinct size records ops of
that size and compiles one XLA program for it (cached in memory and on disk),
and keeps its own replay plan, so a repeated size replays.
No bucketing or padding (padding changes results wherever an op mixes along
the padded dim): results are exact, the first call of each new size pays a
compile (docs/architecture.md).
"""
from __future__ import annotations

import functools
import os
import threading
import weakref
import torch

from . import _C

BACKEND = "tpu"


def _base_name(op) -> str:
    name = op._schema.name
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    """Core ATen decompositions for the ops our lowerings lack (lowered ops stay whole)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    lowered = set(_C._lowered_ops())
    table = dict(core_aten_decompositions())
    # In torch 2.13's core set, not in older ones (2.11 left aten::take to the CPU).
    table.update({op: fn for op, fn in get_decompositions([torch.ops.aten.take, torch.ops.aten.take_along_dim]).items()
                  if op not in table})
    return {op: fn for op, fn in table.items()
            if isinstance(op, torch._ops.OpOverload) and _base_name(op) not in lowered}


_caller_mode = threading.local()  # the mode the user's code runs in, while a compiled call runs fused


def user_mode() -> str:
    return getattr(_caller_mode, "mode", None) or _C._get_mode()


def run_as_one_graph(fn, args):
    """Runs fn(*args) recording in fused mode, then cuts the graph: one XLA program.

    Eager ops the caller recorded just before (the ones backward() seeds the
    gradient with) join the program: in a steady loop they are the same on
    every call, and a separate program for them would cost a launch.
    """
    previous = _C._get_mode()
    outer = getattr(_caller_mode, "mode", None)
    _caller_mode.mode = outer or previous
    if previous != "fused":
        _C._set_mode("fused")  # runs what the previous mode recorded
    try:
        return fn(*args)
    finally:
        _caller_mode.mode = outer
        if previous != "fused":
            _C._set_mode(previous)  # runs the graph recorded by fn
        else:
            _C._sync()


class _CompiledGraph:
    """A boxed callable (AOTAutograd's convention) running one ATen graph as one program.

    The first call records the graph's ops in fused mode and runs them; when
    every input is a tpu tensor and the program's parameters and results map
    to the graph's inputs and outputs, the extension keeps a replay plan, and
    later calls with inputs of the same metadata execute the compiled program
    directly: no op is dispatched, recorded or keyed (the host cost of a call
    no longer grows with its op count). Dynamo's guards keep the op sequence
    of a compiled graph fixed; the plan itself checks the inputs' sizes,
    strides, dtypes, aliasing and buffer types and, if any differ, the call
    runs op by op again.
    """

    def __init__(self, gm):
        self._boxed_call = True  # in the instance's __dict__: wrappers (functools.wraps) copy it
        _note_graph_source(gm)
        self.gm = gm
        # Plans per value of the graph's int arguments (a dynamic-shape graph's
        # sizes: the ops recorded, so the program, differ per size); () if none.
        self.plans = {}  # int arguments -> (plan, the graph's int outputs by position, output count)
        self.captures = {}
        # Data-dependent sizes or values (.item(), nonzero under capture_scalar_outputs or
        # capture_dynamic_output_shape_ops) would be baked into a replay: never replay those.
        self.data_dependent = _has_unbacked_symbols(gm)

    def __call__(self, args):
        args = list(args)
        # Debug mode waits and checks at every op: no replay there.
        split = _C._split_replay_args(args) if _REPLAY and user_mode() != "debug" and not self.data_dependent else None
        replayable = split is not None and len(self.plans) < _MAX_SIZES_REPLAYED
        if split is not None and split[1] in self.plans:
            plan, int_outputs, count = self.plans[split[1]]
            outs = _C._replay(plan, split[0])
            if outs is not None:
                return _with_ints(outs, int_outputs, count)
        previous = _C._get_mode()
        if previous != "fused":
            _C._set_mode("fused")
        size_cuts = _C._set_size_cuts(False)  # one program: what a replay runs
        try:
            if replayable:
                _C._sync()  # the graph to capture holds this graph's ops alone
            # forward(), not the module call: global module hooks (fused mode's
            # end-of-inference cut, under backward's no_grad) must not cut the graph.
            outs = self.gm.forward(*args)
            sizes = split[1] if replayable else None
            if (replayable and self.captures.get(sizes, 0) < 3 and
                    all(o is None or isinstance(o, torch.Tensor) or type(o) is int for o in outs)):
                self.captures[sizes] = self.captures.get(sizes, 0) + 1  # inputs that keep changing layout: stop
                # A dynamic-shape forward also returns sizes (ints) saved for backward: functions
                # of the int arguments and the input metadata, which the plan fixes.
                int_outputs = {i: o for i, o in enumerate(outs) if type(o) is int}
                plan = _C._run_and_capture(split[0], [o for o in outs if type(o) is not int])
                if plan is not None:
                    self.plans[sizes] = (plan, int_outputs, len(outs))
            return outs
        finally:
            _C._set_size_cuts(size_cuts)
            if previous != "fused":
                _C._set_mode(previous)


def _with_ints(tensors, int_outputs, count):
    """The graph's outputs: the replayed tensors with the captured ints at their positions."""
    if not int_outputs:
        return tensors
    it = iter(tensors)
    return [int_outputs[i] if i in int_outputs else next(it) for i in range(count)]


def _has_unbacked_symbols(gm) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        try:
            if free_unbacked_symbols(node.meta.get("val")):
                return True
        except Exception:  # a value the helper does not understand: assume the worst
            return True
    return False


# TORCH_PJRT_COMPILE_REPLAY=0 runs every compiled call op by op (fused).
_REPLAY = os.environ.get("TORCH_PJRT_COMPILE_REPLAY", "1") != "0"
# A dynamic-shape graph keeps a replay plan (and its program) per distinct size, up to this many.
_MAX_SIZES_REPLAYED = 64


def _graph_compiler(gm, example_inputs):
    return _CompiledGraph(gm)


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend registered as 'tpu'."""
    from torch._dynamo.backends.common import aot_autograd

    # Input mutations of inference graphs (a compiled opt.step) stay in the
    # graph, so the parameter updates are part of its one program.
    aot = aot_autograd(fw_compiler=_graph_compiler, bw_compiler=_graph_compiler,
                       inference_compiler=_graph_compiler, decompositions=decompositions(),
                       keep_inference_input_mutations=True)
    compiled = aot(gm, example_inputs, **kwargs)

    def run(*args):
        return run_as_one_graph(compiled, args)

    return run


# ---- errors name the user's line ------------------------------------------
# FX runs a graph as generated code (file "<eval_with_key>.N"). The source
# location hook asks source_line() for such frames: the generated line's node
# carries the stack trace of the user's line that Dynamo traced.
_graph_sources = weakref.WeakValueDictionary()  # generated file name -> GraphModule


def _note_graph_source(gm) -> None:
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


def _register_now() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND not in _COMPILER_FNS:
        register_backend(name=BACKEND)(tpu_backend)


def register() -> None:
    """Registers the backend; importing torch._dynamo costs ~1 s, so only when it is needed.

    If torch._dynamo is loaded already, now; otherwise at the first torch.compile call.
    """
    import sys

    _C._set_generated_code_resolver(source_line)
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
