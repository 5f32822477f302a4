"""TorchTPU's SparseCore ops (torch.tpu.ops.sparse_*) as portable implementations on ordinary PyTorch ops.

TorchTPU runs these on a TPU's SparseCore; here they are gathers, masked sums and index_add (segment sums),
which torch_pjrt lowers to XLA on every PJRT plugin (no CPU fallback, no data-dependent shapes: every
result's shape follows from the inputs' shapes and the integer arguments).

The layout conventions used here (TorchTPU documents them only loosely):

- `row_pointers` (int32, 1D, one entry per row) holds each row's END: row r covers positions
  [row_pointers[r-1], row_pointers[r]) of the value buffers (row 0 starts at 0). Positions at or past
  row_pointers[-1] are padding.
- An entry whose row index (an embedding id or a gathered index) or sample id is outside its tensor's range
  (SparseCore's pad value 2**31 - 1, or -1) is padding as well and contributes nothing.
- sparse_dense_matmul*: one unsharded embedding table on this device; each (embedding_id, sample_id, gain)
  triple adds gain * table[embedding_id] to activations[sample_id] (a weighted-sum combiner; the gains carry
  mean/sqrtn weights). max_ids_per_partition and max_unique_ids_per_partition size SparseCore's buffers and
  are only checked to be positive. The fused optimizer updates touch only the rows that some entry looks up.
- Stacked activations: the features' rows one after another (feature i at rows sum(b[:i]) ... + b[i]), each
  feature's embedding in the first per_feature_dims[i] columns.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sparse_gather", "sparse_gather_backward", "sparse_iota", "sparse_dense_matmul",
           "sparse_dense_matmul_activation_unstack", "sparse_dense_matmul_gradient_stack",
           "sparse_dense_matmul_grad_with_sgd", "sparse_dense_matmul_grad_with_adagrad",
           "sparse_dense_matmul_grad_with_adam"]


def _check_row_pointers(row_pointers):
    if row_pointers.dim() != 1:
        raise ValueError(f"expected row_pointers to be a 1D tensor, got a {row_pointers.dim()}D tensor")
    if row_pointers.dtype != torch.int32:
        raise TypeError(f"expected row_pointers dtype to be torch.int32, got {row_pointers.dtype}")


def _positive(name, value):
    if int(value) <= 0:
        raise ValueError(f"expected {name} to be positive, got {value}")


def _two_d(name, t):
    if t.dim() != 2:
        raise ValueError(f"expected {name} to be a 2D tensor, got a {t.dim()}D tensor")


def _in_range(index, size):
    """(valid, safe index): valid where 0 <= index < size; the safe index is 0 elsewhere."""
    index = index.long()
    valid = (index >= 0) & (index < size)
    return valid, torch.where(valid, index, torch.zeros_like(index))


def _before_end(row_pointers, n):
    """[n] bool: position j is before the last row's end."""
    positions = torch.arange(n, device=row_pointers.device)
    if row_pointers.numel() == 0:
        return torch.zeros(n, dtype=torch.bool, device=row_pointers.device)
    return positions < row_pointers[-1:].long()


def sparse_iota(row_pointers: torch.Tensor, max_non_zeroes: int, max_non_zeroes_per_row: int) -> torch.Tensor:
    """[max_non_zeroes] int32: position j's index within its CSR row (j minus its row's start); -1 for the
    padding positions at or past the last row's end."""
    _check_row_pointers(row_pointers)
    _positive("max_non_zeroes", max_non_zeroes)
    _positive("max_non_zeroes_per_row", max_non_zeroes_per_row)
    positions = torch.arange(int(max_non_zeroes), device=row_pointers.device)
    ends = row_pointers.long()
    # a row's start is the previous row's end: the largest end at or before j (0 when none is)
    ended = ends[None, :] <= positions[:, None]
    starts = torch.where(ended, ends[None, :], torch.zeros_like(ends)[None, :]).amax(1) if ends.numel() else \
        torch.zeros_like(positions)
    out = torch.where(_before_end(row_pointers, positions.numel()), positions - starts, torch.full_like(positions, -1))
    return out.to(torch.int32)


def sparse_gather(row_pointers: torch.Tensor, indices: torch.Tensor, operand: torch.Tensor,
                  max_non_zeroes_per_row: int) -> torch.Tensor:
    """[len(indices), operand.size(1)]: operand's rows at indices; zero rows for padding (positions past the
    last row's end, or indices outside operand). Differentiable in operand: its backward is
    sparse_gather_backward."""
    _check_row_pointers(row_pointers)
    _positive("max_non_zeroes_per_row", max_non_zeroes_per_row)
    _two_d("operand", operand)
    if indices.dim() != 1:
        raise ValueError(f"expected indices to be a 1D tensor, got a {indices.dim()}D tensor")
    want = row_pointers.numel() * int(max_non_zeroes_per_row)
    if indices.numel() != want:
        raise ValueError(f"expected indices length to match the maximum number of non-zeroes, i.e. row_pointers "
                         f"length * maximum number of non-zeroes per row ({want}), got {indices.numel()}")
    valid, safe = _in_range(indices, operand.shape[0])
    valid = valid & _before_end(row_pointers, indices.numel())
    rows = operand.index_select(0, safe)
    return rows * valid[:, None].to(rows.dtype)


def sparse_gather_backward(grad_output: torch.Tensor, indices: torch.Tensor,
                           grad_operand: torch.Tensor) -> torch.Tensor:
    """grad_operand plus grad_output's rows scatter-added at indices (rows whose index is outside grad_operand
    are dropped). A new tensor: grad_operand itself is not modified."""
    _two_d("grad_output", grad_output)
    _two_d("grad_operand", grad_operand)
    valid, safe = _in_range(indices.reshape(-1), grad_operand.shape[0])
    contributions = grad_output * valid[:, None].to(grad_output.dtype)
    return grad_operand.index_add(0, safe, contributions.to(grad_operand.dtype))


def _entries(embedding_ids, sample_ids, gains, table_rows, batch):
    """(valid [n] bool, safe ids, safe samples, gains zeroed at padding)."""
    if not embedding_ids.numel() == sample_ids.numel() == gains.numel():
        raise ValueError(f"expected embedding_ids, sample_ids and gains of one length, got {embedding_ids.numel()}, "
                         f"{sample_ids.numel()} and {gains.numel()}")
    id_ok, ids = _in_range(embedding_ids.reshape(-1), table_rows)
    sample_ok, samples = _in_range(sample_ids.reshape(-1), batch)
    valid = id_ok & sample_ok
    return valid, ids, samples, torch.where(valid, gains.reshape(-1), torch.zeros_like(gains.reshape(-1)))


def _matmul_checks(row_pointers, embedding_table, device_batch_size, max_ids_per_partition,
                   max_unique_ids_per_partition):
    _check_row_pointers(row_pointers)
    _two_d("embedding_table", embedding_table)
    _positive("device_batch_size", device_batch_size)
    _positive("max_ids_per_partition", max_ids_per_partition)
    _positive("max_unique_ids_per_partition", max_unique_ids_per_partition)


def sparse_dense_matmul(row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor,
                        gains: torch.Tensor, embedding_table: torch.Tensor, device_batch_size: int,
                        max_ids_per_partition: int, max_unique_ids_per_partition: int) -> torch.Tensor:
    """[device_batch_size, embedding_table.size(1)]: activations[s] = sum of gain * embedding_table[id] over
    the entries (id, s, gain); padding entries are skipped. Differentiable in embedding_table."""
    _matmul_checks(row_pointers, embedding_table, device_batch_size, max_ids_per_partition,
                   max_unique_ids_per_partition)
    batch = int(device_batch_size)
    _, ids, samples, weights = _entries(embedding_ids, sample_ids, gains, embedding_table.shape[0], batch)
    rows = embedding_table.index_select(0, ids) * weights[:, None].to(embedding_table.dtype)
    out = embedding_table.new_zeros((batch, embedding_table.shape[1]))
    return out.index_add(0, samples, rows)


def _table_grad(embedding_ids, sample_ids, gains, embedding_table, activations_grad, device_batch_size):
    """(the embedding table's gradient, [rows] bool: the rows some entry looks up)."""
    _two_d("activations_grad", activations_grad)
    batch = int(device_batch_size)
    if tuple(activations_grad.shape) != (batch, embedding_table.shape[1]):
        raise ValueError(f"expected activations_grad of shape {(batch, embedding_table.shape[1])}, "
                         f"got {tuple(activations_grad.shape)}")
    valid, ids, samples, weights = _entries(embedding_ids, sample_ids, gains, embedding_table.shape[0], batch)
    rows = activations_grad.index_select(0, samples).to(embedding_table.dtype) * weights[:, None].to(
        embedding_table.dtype)
    grad = torch.zeros_like(embedding_table).index_add(0, ids, rows)
    touched = torch.zeros(embedding_table.shape[0], dtype=torch.int32, device=embedding_table.device).index_add(
        0, ids, valid.to(torch.int32)) > 0
    return grad, touched


def sparse_dense_matmul_grad_with_sgd(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                      activations_grad, learning_rate, device_batch_size, max_ids_per_partition,
                                      max_unique_ids_per_partition, computation_name):
    """The embedding table after one SGD step on sparse_dense_matmul's gradient:
    table - learning_rate * grad (a new tensor)."""
    _matmul_checks(row_pointers, embedding_table, device_batch_size, max_ids_per_partition,
                   max_unique_ids_per_partition)
    grad, _ = _table_grad(embedding_ids, sample_ids, gains, embedding_table, activations_grad, device_batch_size)
    return embedding_table - learning_rate.to(embedding_table) * grad


def sparse_dense_matmul_grad_with_adagrad(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                          accumulator, activations_grad, learning_rate, epsilon, device_batch_size,
                                          max_ids_per_partition, max_unique_ids_per_partition, computation_name):
    """(table, accumulator) after one Adagrad step on the looked-up rows: accumulator += grad**2 (a row-wise,
    1D accumulator adds the row's mean of grad**2), then table -= learning_rate * grad / (sqrt(accumulator) +
    epsilon). Rows that no entry looks up are unchanged."""
    _matmul_checks(row_pointers, embedding_table, device_batch_size, max_ids_per_partition,
                   max_unique_ids_per_partition)
    grad, touched = _table_grad(embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                                device_batch_size)
    if accumulator.dim() == 1 and accumulator.shape[0] == embedding_table.shape[0]:
        new_acc = accumulator + (grad * grad).mean(1).to(accumulator.dtype)
        denom = new_acc.sqrt()[:, None] + epsilon
    elif accumulator.shape == embedding_table.shape:
        new_acc = accumulator + (grad * grad).to(accumulator.dtype)
        denom = new_acc.sqrt() + epsilon
    else:
        raise ValueError(f"expected accumulator of shape {(embedding_table.shape[0],)} or "
                         f"{tuple(embedding_table.shape)}, got {tuple(accumulator.shape)}")
    step = learning_rate.to(embedding_table) * grad / denom.to(embedding_table.dtype)
    new_table = torch.where(touched[:, None], embedding_table - step, embedding_table)
    new_acc = torch.where(touched if accumulator.dim() == 1 else touched[:, None], new_acc, accumulator)
    return new_table, new_acc


def sparse_dense_matmul_grad_with_adam(row_pointers, embedding_ids, sample_ids, gains, embedding_table, momentum,
                                       velocity, activations_grad, alpha_t, beta_1, beta_2, epsilon,
                                       device_batch_size, max_ids_per_partition, max_unique_ids_per_partition,
                                       computation_name):
    """(table, momentum, velocity) after one Adam step on the looked-up rows (lazy Adam):
    m = beta_1 * m + (1 - beta_1) * grad, v = beta_2 * v + (1 - beta_2) * grad**2,
    table -= alpha_t * m / (sqrt(v) + epsilon), alpha_t being the bias-corrected learning rate.
    Rows that no entry looks up are unchanged (their moments do not decay)."""
    _matmul_checks(row_pointers, embedding_table, device_batch_size, max_ids_per_partition,
                   max_unique_ids_per_partition)
    for name, t in (("momentum", momentum), ("velocity", velocity)):
        if t.shape != embedding_table.shape:
            raise ValueError(f"expected {name} of shape {tuple(embedding_table.shape)}, got {tuple(t.shape)}")
    grad, touched = _table_grad(embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                                device_batch_size)
    m = beta_1 * momentum + (1 - beta_1) * grad.to(momentum.dtype)
    v = beta_2 * velocity + (1 - beta_2) * (grad * grad).to(velocity.dtype)
    step = alpha_t.to(embedding_table) * (m / (v.sqrt() + epsilon)).to(embedding_table.dtype)
    keep = touched[:, None]
    return (torch.where(keep, embedding_table - step, embedding_table), torch.where(keep, m, momentum),
            torch.where(keep, v, velocity))


def _feature_checks(batch_sizes, dims):
    if not batch_sizes:
        raise ValueError("expected at least one feature, but per_feature_batch_sizes is empty")
    if len(batch_sizes) != len(dims):
        raise ValueError(f"expected per_feature_batch_sizes and per_feature_dims to have the same size, got "
                         f"{len(batch_sizes)} and {len(dims)}")
    for i, (b, d) in enumerate(zip(batch_sizes, dims)):
        _positive(f"per_feature_batch_sizes[{i}]", b)
        _positive(f"per_feature_dims[{i}]", d)


def sparse_dense_matmul_activation_unstack(stacked_activations: torch.Tensor, per_feature_batch_sizes: Sequence[int],
                                           per_feature_dims: Sequence[int]) -> list[torch.Tensor]:
    """Feature i's activations [per_feature_batch_sizes[i], per_feature_dims[i]]: its rows of the float32
    stacked activations, first per_feature_dims[i] columns. Differentiable (the backward is
    sparse_dense_matmul_gradient_stack)."""
    _two_d("stacked_activations", stacked_activations)
    if stacked_activations.dtype != torch.float32:
        raise TypeError(f"expected stacked_activations to have float32 dtype, got {stacked_activations.dtype}")
    batch_sizes, dims = [int(b) for b in per_feature_batch_sizes], [int(d) for d in per_feature_dims]
    _feature_checks(batch_sizes, dims)
    if sum(batch_sizes) != stacked_activations.shape[0]:
        raise ValueError(f"expected stacked_activations dim 0 ({stacked_activations.shape[0]}) to match total "
                         f"stacked batch size ({sum(batch_sizes)})")
    for i, d in enumerate(dims):
        if d > stacked_activations.shape[1]:
            raise ValueError(f"expected per_feature_dims[{i}] ({d}) to be at most stacked_embedding_dim "
                             f"({stacked_activations.shape[1]})")
    return [part[:, :d] for part, d in zip(stacked_activations.split(batch_sizes, 0), dims)]


def sparse_dense_matmul_gradient_stack(unstacked_gradients: Sequence[torch.Tensor], stacked_batch_size: int,
                                       stacked_feature_dim: int) -> torch.Tensor:
    """[stacked_batch_size, stacked_feature_dim]: the features' gradients one after another, each padded with
    zero columns (the inverse of sparse_dense_matmul_activation_unstack)."""
    _positive("stacked_batch_size", stacked_batch_size)
    _positive("stacked_feature_dim", stacked_feature_dim)
    grads = list(unstacked_gradients)
    if not grads:
        raise ValueError("expected at least one unstacked gradient")
    for i, g in enumerate(grads):
        _two_d(f"unstacked_gradients[{i}]", g)
        if g.shape[1] > stacked_feature_dim:
            raise ValueError(f"expected unstacked_gradients[{i}] dim 1 ({g.shape[1]}) to be at most "
                             f"stacked_feature_dim ({stacked_feature_dim})")
    total = sum(g.shape[0] for g in grads)
    if total != stacked_batch_size:
        raise ValueError(f"expected sum of unstacked gradient batch sizes ({total}) to match stacked_batch_size "
                         f"({stacked_batch_size})")
    pad = torch.nn.functional.pad
    return torch.cat([pad(g, (0, int(stacked_feature_dim) - g.shape[1])) for g in grads], 0)
