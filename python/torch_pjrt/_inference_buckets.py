"""Dynamic batch buckets for inference graphs: which graphs keep their batch rows apart, and how a call runs
padded to a power-of-two bucket (clipped to a mark_dynamic max) and is cut back to its real rows
(docs/design/compiled-mode.md)."""
from __future__ import annotations


import torch

from . import _settings

# TORCH_PJRT_BATCH_BUCKETS=0: graphs with a dynamic batch run at every exact batch size (training graphs too).
_BUCKETS = _settings.flag("TORCH_PJRT_BATCH_BUCKETS")

_bucket_calls = [0]  # calls run at a bucket (tests and benchmarks read it)


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


def _batch_symbols(gm, masked=None, maskable=None):
    """The batch: the size symbols every tensor carries only as a factor of dim 0, if the graph keeps its
    rows apart; else None.

    Every input's dim 0 that is a bare size symbol counts as the batch (a graph may get a tensor's rows and its
    labels' rows as two symbols); a call runs at a bucket only when they all have one value. With a list for
    `masked`, a reduction over the batch that a row mask can restrict to the real rows (maskable(node, batch))
    is allowed too and appended to it (training graphs, rewritten by _training_buckets).
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
            if masked is None or not maskable(n, batch):
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


def _bucket(n: int, upper=None) -> int:
    """The size a batch of n runs at: the next power of two, clipped to the batch's upper bound (a
    mark_dynamic max, or a bound Dynamo derived from a guard), so a bucket never leaves the traced range."""
    size = 1
    while size < n:
        size *= 2
    return size if upper is None or size <= upper else max(n, upper)


class _BatchBuckets:
    """How one graph runs a batch at its bucket: which arguments are the batch, which are padded."""

    def __init__(self, gm, batch):
        self.batch = batch  # the batch's size symbols
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fake = next((n.meta["val"] for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.shape_env = getattr(getattr(fake, "fake_mode", None), "shape_env", None)
        self.guards = None  # the shape guards on the batch, read at the first call (when Dynamo has them all)
        self.upper = ()  # the batch's largest allowed size (None: unbounded), read at the first call
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
            # Symbols a guard made equal are replaced first: the graph names one of them (two inputs marked
            # dynamic, whose sizes a guard found equal, give Eq(s1, s0), which reads True after s1 -> s0).
            guards = None if env is None else [env.replace(g.expr) for g in env.guards]
            self.guards = None if guards is None else [g for g in guards if not g.free_symbols.isdisjoint(self.batch)]
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

    def upper_bound(self):
        """The largest batch the graph was traced for (None: unbounded): the smallest upper end of the batch
        symbols' value ranges, which hold mark_dynamic's max (and bounds Dynamo derived from guards)."""
        if self.upper == ():
            self.upper = _upper_bound(self.shape_env, self.batch)
        return self.upper

    def plan(self, args):
        """(the real batch, the sizes, the rows per padded argument, the size to run at): the bucket, or the
        batch itself when the call must run exactly (sizes() refused, or a guard on the batch fails there)."""
        batch, values, rows = self.sizes(args)
        bucket = _bucket(batch, self.upper_bound())
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


def _upper_bound(shape_env, symbols):
    """The smallest finite upper end of the symbols' value ranges in the shape environment, or None."""
    ranges = getattr(shape_env, "var_to_range", None) or {}
    upper = None
    for s in symbols:
        r = ranges.get(s)
        # int_oo (unbounded) is not an Integer (and claims is_finite)
        end = int(r.upper) if r is not None and getattr(r.upper, "is_Integer", False) else None
        if end is not None and (upper is None or end < upper):
            upper = end
    return upper


def _batch_buckets(gm):
    if not _BUCKETS:
        return None
    try:
        batch = _batch_symbols(gm)
        return _BatchBuckets(gm, batch) if batch is not None else None
    except Exception:  # a graph the analysis does not understand runs at its exact sizes
        return None
