"""The Dynamo backend 'tpu': each AOTAutograd graph runs as one fused XLA program, and replays it.

Dynamo captures a graph, AOTAutograd splits it into a forward and a backward
ATen graph (functionalized; PyTorch's core ATen decompositions only for ops we
have no lowering for). Each graph then runs its ATen nodes on the device in
fused mode and the graph is cut at its end (_OneProgram, the one scope of a
compiled call): the nodes are lowered by exactly the lowerings eager mode uses,
and the whole graph is one XLA program, found again by the fused graph cache on
every later call with the same shapes. Dynamo's guards keep a compiled graph's
op sequence fixed, so a repeated call recompiles nothing (neither in Dynamo nor
in XLA), and later calls replay the captured program directly without
dispatching its ops (_CompiledGraph).

Graph breaks run in the current mode (fused by default) between the compiled
pieces. Dynamic shapes (dynamic=True, mark_dynamic): Dynamo keeps one graph
whose size arguments are ints at run time; each distinct size records ops of
that size and compiles one XLA program for it (cached in memory and on disk),
and keeps its own replay plan, so a repeated size replays. A graph that keeps
its batch rows apart runs each batch size padded to a power-of-two bucket
instead (_inference_buckets), a training graph with its loss's reductions over
the batch masked to the real rows (_training_buckets); padding any other graph
would change its results (docs/design/compiled-mode.md).
"""
from __future__ import annotations

import functools
import threading

import torch

from . import _C
from . import _settings
from . import _inference_buckets as _ib
from ._source_lines import note_graph_source
from ._training_buckets import _TrainingCall, _training_buckets

BACKEND = "tpu"

# TORCH_PJRT_COMPILE_REPLAY=0 runs every compiled call op by op (fused).
_REPLAY = _settings.flag("TORCH_PJRT_COMPILE_REPLAY")
# A dynamic-shape graph keeps a replay plan (and its program) per distinct size, up to this many.
_MAX_SIZES_REPLAYED = 64


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    """Core ATen decompositions for the ops our lowerings lack (lowered ops stay whole)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    # In torch 2.13's core set, not in older ones (2.11 left aten::take to the CPU).
    table.update({op: fn for op, fn in get_decompositions([torch.ops.aten.take, torch.ops.aten.take_along_dim]).items()
                  if op not in table})
    return {op: fn for op, fn in table.items()
            if isinstance(op, torch._ops.OpOverload) and not (_C._op_traits(op.name()) or {}).get("lowering")}


_scope = threading.local()  # .caller: the mode the thread's own code runs in, while it is inside a compiled call


def user_mode() -> str:
    """The calling thread's mode outside compiled calls (inside one, it records in fused mode)."""
    return getattr(_scope, "caller", None) or _C._get_mode()


class _OneProgram:
    """The one scope of a compiled call: what it records runs as one XLA program.

    The outermost scope of a thread gives that thread fused mode (a mode of its
    own: other threads keep theirs; switching runs what its previous mode
    recorded) and, at its end, cuts the graph and gives the thread its mode
    back. Every scope turns the fused graph's size cuts off, so the op and cost
    limits split no graph (one program: what a replay runs). alone=True cuts
    what was recorded before, so the graph a replay plan is captured from
    holds this call's ops alone. A scope inside another (a graph run inside a
    compiled call) neither switches nor cuts: the outer one does.
    """

    __slots__ = ("alone", "outermost", "own_mode", "size_cuts")

    def __init__(self, alone=False):
        self.alone = alone

    def __enter__(self):
        self.outermost = getattr(_scope, "caller", None) is None
        if self.outermost:
            caller = _C._get_mode()
            self.own_mode = _C._set_thread_mode("fused")
            _scope.caller = caller
        self.size_cuts = _C._set_size_cuts(False)
        if self.alone:
            try:
                _C._sync()
            except BaseException:
                self._leave(cut=False)
                raise
        return self

    def __exit__(self, kind, value, traceback):
        self._leave(cut=True)

    def _leave(self, cut):
        _C._set_size_cuts(self.size_cuts)
        if not self.outermost:
            return
        try:
            if cut:
                _C._sync()  # the graph recorded in the scope runs: one program
        finally:
            _scope.caller = None
            _C._set_thread_mode(self.own_mode)


def run_as_one_graph(fn, args):
    """Runs fn(*args) (a compiled function: AOTAutograd's wrappers around its graph) in one _OneProgram scope.

    Eager ops the caller recorded just before (the ones backward() seeds the
    gradient with) join the program: in a steady loop they are the same on
    every call, and a separate program for them would cost a launch.
    """
    with _OneProgram():
        return fn(*args)


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

    def __init__(self, gm, batch_buckets=False):
        self._boxed_call = True  # in the instance's __dict__: wrappers (functools.wraps) copy it
        note_graph_source(gm)
        self.gm = gm
        # Plans per value of the graph's int arguments (a dynamic-shape graph's
        # sizes: the ops recorded, so the program, differ per size); () if none.
        self.plans = {}  # int arguments -> (plan, the graph's int outputs by position, output count)
        self.captures = {}
        # Data-dependent sizes or values (.item(), nonzero under capture_scalar_outputs or
        # capture_dynamic_output_shape_ops) would be baked into a replay: never replay those.
        self.data_dependent = _has_unbacked_symbols(gm)
        # An inference graph that keeps its batch rows apart runs each dynamic batch size at its bucket.
        self.buckets = _ib._batch_buckets(gm) if batch_buckets and not self.data_dependent else None

    def __call__(self, args):
        args = list(args)
        if self.buckets is not None:
            padded = self.buckets.pad(args)
            if padded is not None:
                args, batch, sizes = padded
                _ib._bucket_calls[0] += 1
                return self.buckets.cut_outputs(self._run(args), batch, sizes)
        return self._run(args)

    def _run(self, args):
        # Debug mode waits and checks at every op: no replay there. A graph
        # capture (torch.accelerator.Graph) records the ops: its replay is the step's one program.
        if _C._capturing():
            if any(isinstance(a, torch.Tensor) and a.device.type != "tpu" for a in args):
                # A host tensor's value (a non-capturable optimizer's step count) would be fixed in every replay.
                message = ("a torch.compile graph with CPU tensor inputs cannot be captured in a graph: a replay "
                           "would use their values at capture (use capturable=True optimizers; move the tensors to tpu)")
                _C._fail_capture(torch.tpu.current_device(), message)
                raise RuntimeError(message)
            return self.gm.forward(*args)
        split = _C._split_replay_args(args) if _REPLAY and user_mode() != "debug" and not self.data_dependent else None
        replayable = split is not None and len(self.plans) < _MAX_SIZES_REPLAYED
        if split is not None and split[1] in self.plans:
            plan, int_outputs, count = self.plans[split[1]]
            outs = _C._replay(plan, split[0])
            if outs is not None:
                return _with_ints(outs, int_outputs, count)
        with _OneProgram(alone=replayable):  # alone: the graph to capture holds this graph's ops alone
            # forward(), not the module call: no module hook (fused mode's
            # end-of-inference cut, under backward's no_grad) may cut the graph.
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


def _graph_compiler(gm, example_inputs):
    return _CompiledGraph(gm)


def _inference_compiler(gm, example_inputs):
    return _CompiledGraph(gm, batch_buckets=True)


def _partition(joint_module, joint_inputs, **kwargs):
    """AOTAutograd's default partition, with random ops in a checkpointed region saved, not recomputed.

    Recomputing one in backward takes torch's RNG-state wrappers (rng_prims.run_and_save_rng_state), which
    know only the CUDA, CPU, HPU and XPU generators. Saving its result gives backward the forward's draws,
    as eager checkpointing does by restoring the RNG state; the cost is keeping that one tensor.
    """
    import operator
    from torch._functorch.partitioners import default_partition, must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint_module.graph.nodes:
        if must_recompute(node) and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for user in node.users:  # native_dropout's (output, mask): the partitioner saves the items
                if user.target is operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return default_partition(joint_module, joint_inputs, **kwargs)


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend registered as 'tpu'."""
    from torch._dynamo.backends.common import aot_autograd

    # Input mutations of inference graphs (a compiled opt.step) stay in the
    # graph, so the parameter updates are part of its one program.
    aot = aot_autograd(fw_compiler=_graph_compiler, bw_compiler=_graph_compiler,
                       inference_compiler=_inference_compiler, decompositions=decompositions(),
                       partition_fn=_partition, keep_inference_input_mutations=True)
    training = None
    try:
        training = _training_buckets(gm)
    except Exception:  # a graph the trace or the analysis does not handle runs at its exact sizes
        training = None
    if training is not None:
        traced, buckets = training
        padding = torch.tensor(0, device=example_inputs[buckets.source].device)
        # The trace holds the casts of an autocast region around the call: AOTAutograd must not cast again.
        with torch.autocast("cpu", enabled=False), torch.autocast(BACKEND, enabled=False):
            compiled = _TrainingCall(aot(traced, list(example_inputs) + [padding], **kwargs), buckets)
    else:
        compiled = aot(gm, example_inputs, **kwargs)

    def run(*args):
        return run_as_one_graph(compiled, args)

    return run
