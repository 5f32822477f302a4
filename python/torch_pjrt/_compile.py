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
and keeps its own replay plan, so a repeated size replays. A graph that keeps
its batch rows apart runs each batch size padded to a power-of-two bucket
instead (see "dynamic batch buckets" below), a training graph with its loss's
reductions over the batch masked to the real rows; padding any other graph
would change its results (docs/design/compiled-mode.md).
"""
from __future__ import annotations

import functools
import os
import threading
import weakref
import torch

from . import _C
from . import _settings

BACKEND = "tpu"


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

    def __init__(self, gm, batch_buckets=False):
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
        # An inference graph that keeps its batch rows apart runs each dynamic batch size at its bucket.
        self.buckets = _batch_buckets(gm) if batch_buckets and not self.data_dependent else None

    def __call__(self, args):
        args = list(args)
        if self.buckets is not None:
            padded = self.buckets.pad(args)
            if padded is not None:
                args, batch, sizes = padded
                _bucket_calls[0] += 1
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
        previous = _C._get_mode()
        if previous != "fused":
            _C._set_mode("fused")
        size_cuts = _C._set_size_cuts(False)  # one program: what a replay runs
        try:
            if replayable:
                _C._sync()  # the graph to capture holds this graph's ops alone
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


# ---- dynamic batch buckets --------------------------------------------------
# An inference graph (no autograd) whose every op treats the rows of dim 0
# independently (pointwise ops, matmuls and convolutions over the batch, norms
# and softmax over other dims, views that keep the batch leading) gives each
# row the result it would get alone. Such a graph with a dynamic batch size
# runs at the next power of two: its inputs are padded with zero rows, its
# outputs cut back to the real rows, so every batch size in a bucket replays
# one program. Training graphs: see the next section. Anything else, a graph
# that mixes rows (BatchNorm in training, a cumsum over the batch), draws
# random numbers, or mutates an input, runs at its exact size
# (docs/design/compiled-mode.md).

_ROW_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "clone", "_to_copy", "alias", "detach", "contiguous",
              "lift_fresh_copy", "unsqueeze", "squeeze", "mm", "addmm", "bmm", "baddbmm", "embedding", "convolution",
              "_native_batch_norm_legit_no_training", "max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d",
              "full", "zeros", "ones", "empty", "scalar_tensor", "arange", "new_zeros", "new_ones", "new_empty",
              "new_full", "full_like", "zeros_like", "ones_like", "empty_like", "empty_strided", "permute",
              "transpose", "constant_pad_nd", "native_layer_norm"}
# ops working along a dim argument, which must not be the batch dim: (its position, its default; None: every dim)
_DIM_OPS = {"_softmax": (1, None), "_log_softmax": (1, None), "_safe_softmax": (1, None), "sum": (1, None),
            "mean": (1, None), "amax": (1, None), "amin": (1, None), "prod": (1, None), "var": (1, None),
            "std": (1, None), "var_mean": (1, None), "argmax": (1, None), "argmin": (1, None), "any": (1, None), "all": (1, None),
            "logsumexp": (1, None), "cumsum": (1, None), "max": (1, None), "min": (1, None), "slice": (1, 0),
            "select": (1, None), "split": (2, 0), "split_with_sizes": (2, 0), "chunk": (2, 0), "unbind": (1, 0),
            "cat": (1, 0), "stack": (1, 0), "topk": (2, -1), "sort": (1, -1), "flip": (1, None)}
# Arguments that may be functions of the batch: sizes (the padded graph asks for the padded sizes), and
# arange's end (row i still holds start + i * step). Any other number (a fill value, arange's start) may not.
_SIZE_ARGUMENTS = {"size", "shape", "stride"}
_INT_DIVISIONS = {"div", "floor_divide", "remainder", "fmod"}  # a zero pad row would raise the zero-divisor check


def _symbol_of(size):
    """The sympy expression of a size (None for a plain int)."""
    node = getattr(size, "node", None)
    return node.expr if node is not None else None


def _depends(size, batch) -> bool:
    """A size (or symbolic number) that is a function of a batch symbol."""
    expr = _symbol_of(size)
    return expr is not None and not expr.free_symbols.isdisjoint(batch)


def _per_row(expr, batch):
    """expr / its batch symbol, when expr is one batch symbol times a factor free of them; else None."""
    present = [s for s in expr.free_symbols if s in batch]
    if len(present) != 1:
        return None
    factor = expr / present[0]
    return factor if factor.free_symbols.isdisjoint(batch) else None


def _batch_symbol_in(expr, batch):
    return next(s for s in expr.free_symbols if s in batch)


def _batch_symbols(gm, masked=None):
    """The batch: the size symbols every tensor carries only as a factor of dim 0, if the graph keeps its
    rows apart; else None.

    Every input's dim 0 that is a bare size symbol counts as the batch (a graph may get a tensor's rows and its
    labels' rows as two symbols); a call runs at a bucket only when they all have one value. With a list for
    `masked`, a reduction over the batch that a row mask can restrict to the real rows (_maskable) is allowed
    too and appended to it (training graphs, rewritten by _training_buckets).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims0 = [_symbol_of(n.meta["val"].shape[0]) for n in placeholders
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0]
    batch = frozenset(expr for expr in dims0 if expr is not None and expr.is_Symbol)
    if not batch:
        return _refuse("no input has a dynamic size in dim 0")
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor):
                if not _batch_dims_ok(val, batch):
                    return _refuse("an input has the batch outside dim 0", n)  # it would not be padded
                continue
            if _depends(val, batch) and _symbol_of(val) not in batch:
                return _refuse("an int argument is a function of the batch", n)
            continue
        if n.op == "output":
            if _mentions(list(n.args[0]), batch):
                return _refuse("an int output depends on the batch", n)
            continue
        if n.op == "get_attr":
            continue  # a constant tensor: it cannot have the batch's size
        if n.op != "call_function":
            return _refuse("not a function call", n)
        if not _rows_kept(n, batch):
            if masked is None or not _maskable(n, batch):
                return _refuse("this op mixes rows or uses the batch size as a number", n)
            masked.append(n)
    return batch


def _refuse(reason, node=None):
    """Notes why the last graph analysed runs at exact batch sizes (bucket_refusal()); returns None."""
    _refusal[0] = reason + (f": {node.format_node()}" if node is not None else "")
    return None


_refusal = [""]


def bucket_refusal() -> str:
    """Why the last graph torch.compile analysed runs at exact batch sizes ('' if it runs at buckets)."""
    return _refusal[0]


def _batch_dims_ok(val, batch) -> bool:
    """A batch symbol appears only in dim 0, as a factor of it."""
    vals = val if isinstance(val, (tuple, list)) else [val]
    for v in vals:
        if not isinstance(v, torch.Tensor):
            if _depends(v, batch):
                return False
            continue
        for d, size in enumerate(v.shape):
            if _depends(size, batch) and (d != 0 or _per_row(_symbol_of(size), batch) is None):
                return False
    return True


def _rows_kept(node, batch) -> bool:
    import operator

    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        # arithmetic on sizes (sym_size, operator.mul): fine unless a tensor op uses the result wrongly,
        # which the shape check of that op catches
        return not isinstance(node.meta.get("val"), torch.Tensor)
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target._schema.is_mutable:
        # An in-place pointwise op on an intermediate (label smoothing's masked_fill_) keeps rows apart; on an
        # input, or a view of one, it would write the padded copy. (AOTAutograd's graphs have none.)
        base = _view_base(node.args[0]) if node.args else None
        if not _pointwise(target) or not isinstance(base, torch.fx.Node) or base.op != "call_function":
            return False
    name = target._schema.name.split("::")[-1]
    if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
        if name == "_local_scalar_dense":  # .item() of a tensor without the batch (a module's float attribute)
            return not _carries(node.args[0], batch)
        return name in ("sym_size", "sym_numel", "sym_stride", "sym_storage_offset")  # sizes, not values
    if not _batch_dims_ok(node.meta.get("val"), batch):
        return False
    args = node.args
    # A number that is a function of the batch (`x * x.shape[0]`, a slice bound) would take the padded value.
    schema_args = target._schema.arguments
    named = [(schema_args[i].name if i < len(schema_args) else "", a) for i, a in enumerate(args)]
    for arg_name, value in named + list(node.kwargs.items()):
        sizes = arg_name in _SIZE_ARGUMENTS or (name == "arange" and arg_name == "end")
        if not sizes and not _is_tensor_node(value) and _mentions(value, batch):
            return False
    if name == "slice" and _whole_slice(args):
        return True  # x[:, 1] slices dim 0 from 0 to the end: the identity
    if not any(_carries(a, batch) for a in list(args) + list(node.kwargs.values())) and \
            not _carries(node.meta.get("val"), batch):
        return True  # the op never sees the batch (a weight's transpose)
    if _pointwise(target):
        if name.rstrip("_") in _INT_DIVISIONS:
            inputs = [a.meta.get("val") for a in args if isinstance(a, torch.fx.Node)]
            if any(isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() for v in inputs):
                return False
        return True
    if name in ("mm", "addmm"):
        return not _carries(args[-1], batch)  # mat2 carries no batch
    if name == "embedding":
        # The table carries no batch. scale_grad_by_freq divides the table's gradient by index counts,
        # which padded rows would change.
        return not _carries(args[0], batch) and not (len(args) > 3 and args[3]) and not node.kwargs.get(
            "scale_grad_by_freq", False)
    if name == "convolution":
        return not _carries(args[1], batch)  # the weight
    if name == "index":
        return not _carries(args[0], batch)  # rows of a batch-free table picked per row (weights[labels])
    if name in ("nll_loss_forward", "nll_loss2d_forward"):
        # reduction='none': a loss per row (with class weights that carry no batch); the others reduce the batch
        reduction = args[3] if len(args) > 3 else node.kwargs.get("reduction", 1)
        return reduction == 0 and not _carries(args[2] if len(args) > 2 else node.kwargs.get("weight"), batch)
    if name in _ROW_VIEWS or name in _DIM_OPS:
        dims = _dims_of(node, name)
        return dims is not None and 0 not in dims
    return False


def _pointwise(target) -> bool:
    """PyTorch's pointwise tag, which in-place overloads lack (masked_fill_): then their functional twin's."""
    if torch.Tag.pointwise in target.tags:
        return True
    if torch.Tag.inplace not in target.tags:
        return False
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1].rstrip("_"), None)
    functional = getattr(packet, target._overloadname, None) if packet is not None else None
    return functional is not None and torch.Tag.pointwise in functional.tags


def _view_base(node):
    """The node whose storage a node shares, through views and in-place ops (their results alias self)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and \
            isinstance(node.target, torch._ops.OpOverload) and node.target._schema.returns and \
            node.target._schema.returns[0].alias_info is not None and node.args:
        node = node.args[0]
    return node


def _whole_slice(args) -> bool:
    dim = args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return dim == 0 and start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2 ** 62))


def _carries(value, batch) -> bool:
    """A tensor (or a node or list of them) with the batch in its shape."""
    if isinstance(value, (list, tuple)):
        return any(_carries(v, batch) for v in value)
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    return isinstance(value, torch.Tensor) and any(_depends(s, batch) for s in value.shape)


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _mentions(value, batch) -> bool:
    """A non-tensor argument (a number, a list of them, a size node) that depends on the batch."""
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, batch) for v in value)
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    return not isinstance(value, torch.Tensor) and _depends(value, batch)


def _dims_of(node, name):
    """The dims an op works along (normalized; empty for none), or None when it works along every dim."""
    args, kwargs = node.args, node.kwargs
    if name not in _DIM_OPS and name not in ("native_layer_norm", "permute", "transpose", "constant_pad_nd"):
        return set()  # no dim argument: a view, a matmul, a factory (the shape check covers them)
    first = args[0]
    if isinstance(first, (list, tuple)):  # cat, stack: a list of tensors (cat's may hold empty 1-d ones)
        first = node
    first = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    if not isinstance(first, torch.Tensor):
        return None
    rank = max(first.dim(), 1)
    if name == "native_layer_norm":
        return set(range(rank - len(args[1]), rank))
    if name == "permute":
        return set() if list(args[1])[0] % rank == 0 else {0}
    if name == "transpose":
        return {a % rank for a in args[1:3]}
    if name == "constant_pad_nd":
        return {rank - 1 - i // 2 for i, p in enumerate(args[1]) if p != 0}
    position, default = _DIM_OPS[name]
    dim = args[position] if len(args) > position else kwargs.get("dim", default)
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if len(dims) == 0:
        return None  # an empty dim list reduces everything
    return {d % rank for d in dims}


def _bucket(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


class _BatchBuckets:
    """How one graph runs a batch at its bucket: which arguments are the batch, which are padded."""

    def __init__(self, gm, batch):
        self.batch = batch  # the batch's size symbols
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake = next((n.meta["val"] for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.shape_env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
        self.guards = None  # the shape guards on the batch, read at the first call (when Dynamo has them all)
        self.guards_hold = {}  # (bucket, sizes) -> whether they all hold at the bucket
        self.symbols = {}  # bare size symbol -> int argument index
        self.dims = []     # (tensor argument index, dim, bare size symbol): the sizes the tensors give
        self.padded = {}   # tensor argument index -> dim 0 / batch (a sympy expression in other sizes)
        self.sources = {}  # batch symbol -> a tensor argument index whose dim 0 it is
        for i, n in enumerate(placeholders):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                for d, size in enumerate(val.shape):
                    expr = _symbol_of(size)
                    if expr is not None and expr.is_Symbol:
                        self.dims.append((i, d, expr))
                if val.dim() > 0 and _depends(val.shape[0], batch):
                    self.padded[i] = _per_row(_symbol_of(val.shape[0]), batch)
                    if _symbol_of(val.shape[0]) in batch:
                        self.sources.setdefault(_symbol_of(val.shape[0]), i)
            else:
                expr = _symbol_of(val)
                if expr is not None and expr.is_Symbol:
                    self.symbols[expr] = i
        self.source = next(iter(self.sources.values()))  # an argument whose dim 0 is the batch
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.cut = []  # per output: dim 0 / batch, or None
        for out in output.args[0]:
            val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
            batched = isinstance(val, torch.Tensor) and val.dim() > 0 and _depends(val.shape[0], batch)
            self.cut.append(_per_row(_symbol_of(val.shape[0]), batch) if batched else None)

    def sizes(self, args):
        """(the real batch, the value of every size symbol the arguments give, the rows per padded argument),
        with None for the rows when the call cannot run at a bucket (batch symbols of different values, a
        factor that is not a plain size)."""
        values = {s: args[i] for s, i in self.symbols.items()}
        for i, d, expr in self.dims:
            values.setdefault(expr, args[i].shape[d])
        batch = args[self.source].shape[0]
        if any(values.get(s, batch) != batch for s in self.batch):
            return batch, values, None
        try:
            return batch, values, {i: int(c.subs(values)) for i, c in self.padded.items()}
        except (TypeError, ValueError):
            return batch, values, None

    def holds_at(self, bucket, values) -> bool:
        """Whether every shape guard that mentions the batch holds with the batch at the bucket: a graph traced
        under a relation such as batch * length == 15 must not see the padded batch."""
        if self.guards is None:
            env = self.shape_env
            self.guards = None if env is None else [g.expr for g in env.guards if not g.expr.free_symbols.isdisjoint(
                self.batch)]
        if self.guards is None:
            return False
        key = (bucket, tuple(values.values()))  # sizes() fills values in one order on every call
        held = self.guards_hold.get(key)
        if held is None:
            at_bucket = dict(values)
            at_bucket.update({s: bucket for s in self.batch})
            try:
                held = all(bool(g.subs(at_bucket)) for g in self.guards)
            except TypeError:  # a symbol without a value: not decidable
                held = False
            self.guards_hold[key] = held
        return held

    def at_bucket(self, args, batch, rows, bucket, pad):
        """The arguments with every batch argument padded to the bucket by pad(tensor, extra rows)."""
        padded = list(args)
        for i, per_row in rows.items():
            padded[i] = pad(args[i], (bucket - batch) * per_row)
        for s in self.batch:
            if s in self.symbols:
                padded[self.symbols[s]] = bucket
        return padded

    def plan(self, args):
        """(the real batch, the sizes, the rows per padded argument, the size to run at): the bucket, or the
        batch itself when the call must run exactly (sizes() refused, or a guard on the batch fails there)."""
        batch, values, rows = self.sizes(args)
        bucket = _bucket(batch)
        if rows is None or bucket == batch or not self.holds_at(bucket, values):
            bucket = batch
        return batch, values, rows, bucket

    def pad(self, args):
        """(the arguments at the bucket with zero rows, the real batch, the sizes), or None to run at the exact
        size."""
        batch, values, rows, bucket = self.plan(args)
        if bucket == batch:
            return None
        zeros = lambda t, extra: torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, extra])
        return self.at_bucket(args, batch, rows, bucket, zeros), batch, values

    def cut_outputs(self, outs, batch, values):
        cut = list(outs)
        for k, per_row in enumerate(self.cut):
            if per_row is not None and isinstance(cut[k], torch.Tensor):
                cut[k] = cut[k].narrow(0, 0, batch * int(per_row.subs(values)))
        return cut


def _batch_buckets(gm):
    if not _BUCKETS:
        return None
    try:
        batch = _batch_symbols(gm)
        return _BatchBuckets(gm, batch) if batch is not None else None
    except Exception:  # a graph the analysis does not understand runs at its exact sizes
        return None


# ---- dynamic batch buckets for training graphs ------------------------------
# A training graph mixes its rows twice: its loss usually sums or averages over
# the batch, and backward sums every weight gradient over it. Such a graph is
# traced to ATen before AOTAutograd (below autograd, as AOTAutograd would) and
# accepted when it keeps its rows apart except for reductions a row mask can
# restrict to the real rows: a sum or a mean over the batch, and nll_loss
# (cross_entropy), whose padded targets become its ignore_index. Those get the
# mask; the number of padded rows is one more graph input (a 0-d tensor, so
# every batch size in a bucket is one program, and 0 keeps every row at an
# exact size); AOTAutograd then differentiates the rewritten graph. Padded rows
# thus get exactly zero gradient and add nothing to any weight gradient.
# Inputs are padded with copies of their last row, outside autograd: a real
# row's values are finite wherever the real rows' are, where zero rows could
# give 0 * inf = nan in a gradient.

_MASKABLE = {"sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "nll_loss_forward.default",
             "nll_loss2d_forward.default"}
# Losses with their own ATen op, decomposed into pointwise ops and a sum or mean the mask can take. Only
# those whose decomposition differentiates like the ATen op, infinities included: binary_cross_entropy's
# takes log(p) (nan gradient at p = 1 where ATen's formula clamps), so it stays whole (exact sizes).
_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
           "soft_margin_loss")


def _maskable(node, batch) -> bool:
    """A reduction over the batch that a mask of the padded rows makes exact."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name.split("::")[-1]
    if f"{name}.{target._overloadname}" not in _MASKABLE:
        return False
    x = node.args[0]
    if not _is_tensor_node(x) or not _batch_dims_ok(x.meta["val"], batch) or _carries(node.meta.get("val"), batch):
        return False  # an input with the batch elsewhere, or an output that keeps rows (reduction='none')
    if any(_mentions(a, batch) for a in list(node.args[1:]) + list(node.kwargs.values())):
        return False
    if name.startswith("nll_loss"):
        labels = node.args[1]
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        return (_is_tensor_node(labels) and _carries(labels, batch) and _batch_dims_ok(labels.meta["val"], batch)
                and not _carries(weight, batch))
    return True


def _real_rows(x, rows_of, padding):
    """How many leading rows of x hold the real batch. Dim 0 of x is a multiple of the batch (dim 0 of
    rows_of), and the last `padding` rows of each multiple are padding."""
    return x.shape[0] - padding * (x.shape[0] // rows_of.shape[0])


def _row_mask(x, rows_of, padding):
    """True on the rows of x that hold the real batch."""
    keep = torch.arange(x.shape[0], device=x.device) < _real_rows(x, rows_of, padding)
    return keep.view([x.shape[0]] + [1] * (x.dim() - 1))


def _masked_sum(rows_of, padding, x, *args, **kwargs):
    return torch.ops.aten.sum(torch.where(_row_mask(x, rows_of, padding), x, 0), *args, **kwargs)


def _masked_mean(rows_of, padding, x, dim=None, keepdim=False, *, dtype=None):
    # The sum over the real rows divided by their count, rounded once: what the exact size's mean computes
    # (a half-precision mean sums and divides in float32).
    result = dtype or x.dtype
    wide = torch.float32 if result in (torch.float16, torch.bfloat16) else result
    total = _masked_sum(rows_of, padding, x, dim or [], keepdim, dtype=wide)
    count = _real_rows(x, rows_of, padding)
    for d in sorted({d % x.dim() for d in dim} if dim else range(x.dim())):
        if d != 0:
            count = count * x.shape[d]
    return (total / count).to(result)


def _masked_nll(name, rows_of, padding, x, labels, *args):
    ignore_index = args[-1]
    labels = torch.where(_row_mask(labels, rows_of, padding), labels, ignore_index)
    return getattr(torch.ops.aten, name).default(x, labels, *args)


def _output_views_an_input(gm, batch) -> bool:
    """An output that is a view (through any chain of views) of an input with the batch."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.args[0]:
        base = _view_base(node)
        if isinstance(base, torch.fx.Node) and base.op == "placeholder" and _carries(base, batch):
            return True
    return False


def _global_state_free(gm) -> bool:
    """A Dynamo graph whose ATen trace keeps its meaning: no grad-mode, autocast or other global-state switch
    (tracing below autograd forgets them) and no higher-order op (checkpoint, autograd.Function)."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            return False
        if n.op == "call_method" and n.target in ("requires_grad_", "retain_grad", "register_hook", "backward"):
            return False
        if n.op != "call_function":
            continue
        if isinstance(n.target, torch._ops.HigherOrderOperator):
            return False
        name = getattr(n.target, "__name__", "")
        if "grad" in name or "autocast" in name or name.startswith("_set_") or "seed" in name or "rng" in name:
            return False
    return True


def _training_buckets(gm):
    """(the Dynamo graph as an ATen graph with masked reductions and a padding input, its _BatchBuckets),
    or None when the graph must run at exact sizes."""
    from torch._decomp import get_decompositions
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import make_fx
    import torch.fx.traceback as fx_traceback

    if not _BUCKETS or not torch.is_grad_enabled():
        return None
    fake = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [v for v in fake if isinstance(v, FakeTensor)]
    if not any(v.requires_grad for v in tensors):
        return None  # inference: _inference_compiler's buckets
    if not any(v.dim() > 0 and _symbol_of(v.shape[0]) is not None and _symbol_of(v.shape[0]).is_Symbol
               for v in tensors):
        return None  # no dynamic batch
    if not _global_state_free(gm):
        return _refuse("the graph switches grad mode or autocast, or has a higher-order op")
    losses = get_decompositions([getattr(torch.ops.aten, name) for name in _LOSSES])
    with tensors[0].fake_mode, fx_traceback.preserve_node_meta():
        # The interpreter sets each Dynamo node's meta while its ops are traced: errors keep the user's line.
        # Not functionalized: torch.func.functionalize would specialize the sizes (it adds Eq guards).
        traced = make_fx(torch.fx.Interpreter(gm).run, decomposition_table=losses)(*fake)
    traced.graph.eliminate_dead_code()
    masked = []
    batch = _batch_symbols(traced, masked)
    if batch is None:
        return None
    if _output_views_an_input(traced, batch):
        # The padded copy is what the compiled function sees: a view of it would not write through to the input.
        return _refuse("an output is a view of a batch input")
    buckets = _BatchBuckets(traced, batch)
    graph = traced.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        padding = graph.placeholder("padding")
    for node in masked:
        name = node.target._schema.name.split("::")[-1]
        rows = node.args[1 if name.startswith("nll_loss") else 0]
        rows_of = placeholders[buckets.sources[_batch_symbol_in(_symbol_of(rows.meta["val"].shape[0]), batch)]]
        with graph.inserting_before(node):
            if name == "sum":
                new = graph.call_function(_masked_sum, (rows_of, padding) + tuple(node.args), dict(node.kwargs))
            elif name == "mean":
                new = graph.call_function(_masked_mean, (rows_of, padding) + tuple(node.args), dict(node.kwargs))
            else:
                args = list(node.args) + [node.kwargs.get(a.name, a.default_value)
                                         for a in node.target._schema.arguments[len(node.args):]]
                new = graph.call_function(_masked_nll, (name, rows_of, padding) + tuple(args))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    traced.recompile()
    _refusal[0] = ""
    return traced, buckets


class _TrainingCall:
    """Runs a training graph's compiled function at the bucket of its batch, with the padding as input."""

    def __init__(self, compiled, buckets):
        self.compiled = compiled
        self.buckets = buckets
        self.paddings = {}  # (device, rows of padding) -> the 0-d tensor holding it

    def __call__(self, *args):
        b = self.buckets
        batch, values, rows, bucket = b.plan(args)
        if batch == 0:
            bucket = batch  # an empty batch has no last row to copy: it runs exactly
        if bucket != batch:
            # Copies of the last row, outside autograd: no gradient reaches them (the masks give them none).
            repeat = lambda t, extra: torch.cat([t, t[-1:].detach().expand(extra, *t.shape[1:])])
            args = b.at_bucket(args, batch, rows, bucket, repeat)
        device = args[b.source].device
        padding = self.paddings.get((device, bucket - batch))
        if padding is None:
            padding = self.paddings[(device, bucket - batch)] = torch.tensor(bucket - batch, device=device)
        outs = self.compiled(*args, padding)
        if bucket == batch:
            return outs
        _bucket_calls[0] += 1
        cut = b.cut_outputs(outs, batch, values)
        return type(outs)(cut) if isinstance(outs, tuple) else cut


# TORCH_PJRT_BATCH_BUCKETS=0: inference graphs with a dynamic batch run at every exact batch size.
_BUCKETS = _settings.flag("TORCH_PJRT_BATCH_BUCKETS")

_bucket_calls = [0]  # calls run at a bucket (tests and benchmarks read it)


# TORCH_PJRT_COMPILE_REPLAY=0 runs every compiled call op by op (fused).
_REPLAY = _settings.flag("TORCH_PJRT_COMPILE_REPLAY")
# A dynamic-shape graph keeps a replay plan (and its program) per distinct size, up to this many.
_MAX_SIZES_REPLAYED = 64


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


# ---- flex_attention ----------------------------------------------------------
# torch's flex_attention refuses devices outside its list (CUDA, CPU, XPU, HPU,
# MPS) before anything runs. On tpu, eager calls run the higher-order op's dense
# implementation (scores materialized, score_mod and mask_mod applied to them,
# softmax, @v; its backward likewise) through the eager lowerings, and compiled
# calls keep the op in the graph this backend runs as one program, so the
# numbers are the CPU's dense ones in both. Block sparsity only skips work
# there: the mask_mod decides which scores count.


def allow_flex_attention() -> None:
    import torch.nn.attention.flex_attention as flex

    validate = flex._validate_device
    if getattr(validate, "_torch_pjrt_allowed", False):
        return

    @functools.wraps(validate)
    def _validate_device(query, key, value):
        if query.device.type == BACKEND:
            return None  # every device check after this one is about CUDA's kernels
        return validate(query, key, value)

    _validate_device._torch_pjrt_allowed = True
    flex._validate_device = _validate_device
