"""Dynamic batch buckets for training graphs: the loss's reductions over the batch masked to the real rows, so
a padded call gives the exact size's loss and gradients (docs/design/compiled-mode.md)."""
from __future__ import annotations

import torch

from . import _inference_buckets as _ib
from ._inference_buckets import (_BatchBuckets, _batch_dims_ok, _batch_symbol_in, _batch_symbols, _carries,
                                 _is_tensor_node, _mentions, _refuse, _refusal, _symbol_of, _view_base)


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

    if not _ib._BUCKETS or not torch.is_grad_enabled():
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
    batch = _batch_symbols(traced, masked, _maskable)
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
        _ib._bucket_calls[0] += 1
        cut = b.cut_outputs(outs, batch, values)
        return type(outs)(cut) if isinstance(outs, tuple) else cut
