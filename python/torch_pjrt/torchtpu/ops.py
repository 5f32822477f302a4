"""torch.tpu.ops: TorchTPU's custom ops, on PyTorch ops that torch_pjrt lowers.

- optimization_barrier: stablehlo.optimization_barrier through a jax_op (needs jax);
- max_pool{1,2,3}d and their _backward: PyTorch's max pooling (the backward recomputes the maxima's positions
  from the input, as TorchTPU's does; ties go to the first maximum, as in PyTorch);
- ragged_dot, ragged_dot_weight_grad: one masked contraction over the groups (no data-dependent shapes);
- all_gather_dim, reduce_scatter_dim, send, recv, ragged_all_to_all: torch.distributed collectives (tpu_dist);
- sparse_gather, sparse_gather_backward, sparse_iota, sparse_dense_matmul*: portable implementations of
  TorchTPU's SparseCore ops (_sparsecore.py: gathers, masked sums and index_add);
- splash_sdpa: F.scaled_dot_product_attention with splash's masks (causal, or causal sliding window); the
  Pallas splash kernel's block sizes and layouts only tune that kernel and are ignored.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import _sparsecore
from ._sparsecore import (sparse_dense_matmul, sparse_dense_matmul_activation_unstack,  # noqa: F401
                          sparse_dense_matmul_grad_with_adagrad, sparse_dense_matmul_grad_with_adam,
                          sparse_dense_matmul_grad_with_sgd, sparse_dense_matmul_gradient_stack, sparse_gather,
                          sparse_gather_backward, sparse_iota)

__all__ = ["optimization_barrier", "max_pool1d", "max_pool1d_backward", "max_pool2d", "max_pool2d_backward",
           "max_pool3d", "max_pool3d_backward", "ragged_dot", "ragged_dot_weight_grad", "all_gather_dim",
           "reduce_scatter_dim", "send", "recv", "ragged_all_to_all", "splash_sdpa", *_sparsecore.__all__]

_barrier = None
_barrier_lock = threading.Lock()


def optimization_barrier(inputs):
    """The same tensors behind an XLA optimization barrier (a list, in order): nothing moves across it and the
    computations on either side are not fused or deduplicated together. Use the returned tensors."""
    global _barrier
    inputs = list(inputs)
    if not inputs:
        return []
    with _barrier_lock:
        if _barrier is None:
            import torch_pjrt

            from .. import _jax

            jax = _jax._jax()
            _barrier = torch_pjrt.jax_op("torch_tpu_compat::optimization_barrier",
                                         lambda *xs: jax.lax.optimization_barrier(tuple(xs)))
    out = _barrier(*inputs)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _pool(n):
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]

    def forward(input, kernel_size, stride, padding, dilation, ceil_mode):
        return pool(input, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)

    def backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode):
        with torch.enable_grad():
            x = input.detach().requires_grad_(True)
            y = pool(x, list(kernel_size), list(stride), list(padding), list(dilation), ceil_mode)
            (grad,) = torch.autograd.grad(y, x, grad_output)
        return grad

    forward.__name__, backward.__name__ = f"max_pool{n}d", f"max_pool{n}d_backward"
    forward.__doc__ = (f"{n}d max pooling without indices (kernel_size, stride, padding, dilation: {n} ints each; "
                       "padding is -inf).")
    backward.__doc__ = f"The gradient of max_pool{n}d with respect to its input (maxima recomputed from input)."
    return forward, backward


max_pool1d, max_pool1d_backward = _pool(1)
max_pool2d, max_pool2d_backward = _pool(2)
max_pool3d, max_pool3d_backward = _pool(3)


def _group_mask(group_sizes, rows, dtype):
    """[rows, g]: row r belongs to group i (rows past the groups' total belong to none)."""
    ends = torch.cumsum(group_sizes, 0)
    r = torch.arange(rows, device=group_sizes.device)[:, None]
    return ((r >= (ends - group_sizes)[None, :]) & (r < ends[None, :])).to(dtype)


def ragged_dot(lhs, rhs, group_sizes, *, out=None):
    """Rows of lhs [m, k] in consecutive groups of group_sizes[i] rows, group i times rhs[i] ([g, k, n]) ->
    [m, n] (zero past the groups' total). Differentiable in lhs and rhs when out is not given."""
    mask = _group_mask(group_sizes.to(lhs.device), lhs.shape[0], lhs.dtype)
    result = torch.einsum("mk,gkn,mg->mn", lhs, rhs, mask)
    if out is None:
        return result
    return out.copy_(result)


def ragged_dot_weight_grad(lhs, grad_output, group_sizes):
    """ragged_dot's gradient with respect to rhs: [g, k, n], group i's lhs rows transposed times its
    grad_output rows."""
    mask = _group_mask(group_sizes.to(lhs.device), lhs.shape[0], lhs.dtype)
    return torch.einsum("mk,mn,mg->gkn", lhs, grad_output, mask)


def _dim(input, dim):
    if input.dim() < 1:
        raise ValueError("expected a tensor with at least one dimension")
    if not -input.dim() <= dim < input.dim():
        raise IndexError(f"dim {dim} is out of range for a {input.dim()}-d tensor")
    return dim % input.dim()


def all_gather_dim(input, dim, group=None):
    """Every rank's input, concatenated along dim in rank order (no autograd)."""
    import torch.distributed as dist

    d = _dim(input, dim)
    world = dist.get_world_size(group)
    moved = input.detach().movedim(d, 0).contiguous()
    gathered = moved.new_empty((moved.shape[0] * world, *moved.shape[1:]))
    dist.all_gather_into_tensor(gathered, moved, group=group)
    return gathered.movedim(0, d).contiguous()


_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def reduce_scatter_dim(input, dim, group=None, reduce_op="sum"):
    """input reduced across ranks with reduce_op, then this rank's chunk along dim (no autograd)."""
    import torch.distributed as dist

    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {', '.join(_REDUCE_OPS)}, got {reduce_op!r}")
    if reduce_op in ("band", "bor", "bxor") and (input.dtype.is_floating_point or input.dtype.is_complex):
        raise ValueError(f"reduce_op {reduce_op!r} needs an integer tensor, got {input.dtype}")
    d = _dim(input, dim)
    world = dist.get_world_size(group)
    if input.shape[d] % world:
        raise ValueError(f"input.size({dim}) = {input.shape[d]} is not divisible by the group size {world}")
    op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
          "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
          "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}[reduce_op]
    moved = input.detach().movedim(d, 0).contiguous()
    chunk = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    dist.reduce_scatter_tensor(chunk, moved, op=op, group=group)
    return chunk.movedim(0, d).contiguous()


class _Works:
    """The point-to-point operations of one send or recv call: wait() waits for all of them."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self, timeout=None):
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def send(tensors, dst, tag):
    """Sends the tensors to rank dst of the default process group; wait() on the result."""
    import torch.distributed as dist

    return _Works(dist.isend(t, dst, tag=tag) for t in tensors)


def recv(tensors, src, tag):
    """Receives into the tensors from rank src of the default process group; wait() before using them."""
    import torch.distributed as dist

    return _Works(dist.irecv(t, src, tag=tag) for t in tensors)


def _ints(t):
    return [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def _ragged_exchange(operand, output, send_starts, send_sizes, recv_sizes, recv_starts, group):
    """output with, for each rank j, the recv_sizes[j] rows that j sent here written at recv_starts[j]; this
    rank sends operand rows [send_starts[j], + send_sizes[j]) to rank j. All offsets and sizes are ints."""
    import torch.distributed as dist

    rest = operand.shape[1:]
    packed = torch.cat([operand.narrow(0, s, n) for s, n in zip(send_starts, send_sizes)], 0) if sum(send_sizes) \
        else operand.new_empty((0, *rest))
    received = operand.new_empty((sum(recv_sizes), *rest))
    dist.all_to_all_single(received, packed.contiguous(), recv_sizes, send_sizes, group=group)
    result = output.clone()
    at = 0
    for start, n in zip(recv_starts, recv_sizes):
        if n:
            result[start:start + n] = received[at:at + n]
        at += n
    return result


class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, operand, output, send_starts, send_sizes, recv_sizes, recv_starts, group):
        ctx.save = (send_starts, send_sizes, recv_sizes, recv_starts, group, operand.shape)
        return _ragged_exchange(operand, output, send_starts, send_sizes, recv_sizes, recv_starts, group)

    @staticmethod
    def backward(ctx, grad):
        send_starts, send_sizes, recv_sizes, recv_starts, group, shape = ctx.save
        # the reverse exchange: the rows this rank received go back to where their senders took them from
        zeros = grad.new_zeros(shape)
        grad_operand = _ragged_exchange(grad.contiguous(), zeros, recv_starts, recv_sizes, send_sizes, send_starts,
                                        group)
        return grad_operand, None, None, None, None, None, None


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, process_group_name,
                      *, out=None):
    """Rank i sends operand rows [input_offsets[j], + send_sizes[j]) to rank j, which writes them into its
    result (a copy of output) at row output_offsets[j] as given by the sender; recv_sizes[j] is how many rows
    come from rank j. The process group is named by process_group_name (ProcessGroup.group_name; "" or
    None: the default group). Differentiable in operand when out is not given. The offsets and sizes are read
    on the host (one synchronization), then one torch.distributed.all_to_all_single with those split sizes
    moves the rows, after one moving the output offsets."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group = c10d._resolve_process_group(process_group_name) if process_group_name else None
    world = dist.get_world_size(group)
    lists = [_ints(t) for t in (input_offsets, send_sizes, output_offsets, recv_sizes)]
    for name, values in zip(("input_offsets", "send_sizes", "output_offsets", "recv_sizes"), lists):
        if len(values) != world:
            raise ValueError(f"expected {name} to have one entry per rank ({world}), got {len(values)}")
    send_starts, sends, dest_offsets, recvs = lists
    # where each sender wants its rows here: sender j's output_offsets[this rank]
    theirs = torch.empty(world, dtype=torch.int64, device=operand.device)
    dist.all_to_all_single(theirs, torch.tensor(dest_offsets, dtype=torch.int64, device=operand.device),
                           group=group)
    recv_starts = _ints(theirs.cpu())
    if out is not None:
        with torch.no_grad():
            return out.copy_(_ragged_exchange(operand, output, send_starts, sends, recvs, recv_starts, group))
    return _RaggedAllToAll.apply(operand, output, send_starts, sends, recvs, recv_starts, group)


_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")


def splash_sdpa(q, k, v, *, scale=None, is_causal=True, local_window_size=None, enable_gqa=False, block_q=512,
                block_kv=512, block_dkv=512, block_kv_compute=512, block_q_dkv=512, block_kv_dkv=512,
                block_kv_dkv_compute=512, block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True,
                use_vmap_bwd=True, q_layout="HEAD_DIM_MINOR", k_layout="HEAD_DIM_MINOR", v_layout="HEAD_DIM_MINOR"):
    """Attention of q [b, h, s, d] over k, v [b, h_kv, s, d]: causal (default), causal within the previous
    local_window_size keys and the query's own, or full (is_causal=False). enable_gqa must say whether
    h_kv != h. The block sizes and layouts tune TorchTPU's Pallas kernel and are ignored here."""
    for layout in (q_layout, k_layout, v_layout):
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
    n_heads, n_kv_heads, seq_len = q.shape[1], k.shape[1], q.shape[2]
    if enable_gqa != (n_heads != n_kv_heads):
        raise ValueError(f"enable_gqa ({enable_gqa}) does not match inputs: n_heads={n_heads}, "
                         f"n_kv_heads={n_kv_heads}")
    if k.shape[2] != seq_len or v.shape[2] != seq_len:
        raise ValueError("splash_sdpa expects queries and keys of the same sequence length")
    mask, causal = None, is_causal
    if local_window_size is not None:
        i = torch.arange(seq_len, device=q.device)
        distance = i[:, None] - i[None, :]
        mask, causal = (distance >= 0) & (distance <= local_window_size), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return out.to(q.dtype)
