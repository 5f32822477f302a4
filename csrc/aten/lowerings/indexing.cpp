// Gathers and scatters: index_select, gather, scatter(_add), index_copy, advanced
// indexing (index.Tensor, index_put_), embedding_dense_backward. XLA clamps
// out-of-range gather indices and drops such scatter updates; where the CPU
// raises, each lowering declares a runtime check (Context::check) with the
// CPU's error, which the host raises at its next wait.
#include <optional>
#include <string>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

Value as_index(Builder& b, const Value& i) { return b.convert(i, ElementType::S64); }

// `size`: a number, or "{size}" for one known at runtime (RuntimeCheck::size).
std::string out_of_bounds(int64_t dim, const std::string& size) {
  return "index {} is out of bounds for dimension " + std::to_string(dim) + " with size " + size;
}
std::string out_of_bounds(int64_t dim, int64_t size) { return out_of_bounds(dim, std::to_string(size)); }
// gather and the scatter family: indices in [0, size) along `dim`; the CPU
// raises RuntimeError.
void check_dim_index(Context& c, const Value& index, const Value& x, int64_t dim) {
  int64_t size = x.rank() == 0 ? 1 : x.dims()[dim];
  check_in_range(c, index, size, false, CheckError::Runtime, out_of_bounds(dim, size));
}
// index_select (embedding) and index_reduce: the CPU raises IndexError, but
// RuntimeError from its own kernel for index_select along dim 1.
void check_select_index(Context& c, const Value& index, int64_t size, int64_t dim) {
  check_in_range(c, index, size, false, CheckError::Index, "index out of range in self (" + out_of_bounds(dim, size) + ")");
}
void check_index_select(Context& c, const Value& index, const Value& x, int64_t dim) {
  if (x.rank() < 2 || dim != 1) return check_select_index(c, index, x.rank() == 0 ? 1 : x.dims()[dim], dim);
  check_in_range(c, index, x.dims()[1], false, CheckError::Runtime,
                 "INDICES element is out of DATA bounds, id={} axis_dim=" + std::to_string(x.dims()[1]));
}

// Negative indices count from the end, as in Python (a runtime-length dim: from its runtime size).
Value wrap_negative(Builder& b, Value i, int64_t size, std::optional<Value> runtime_size = std::nullopt) {
  Value zero = b.constant_int(0, ElementType::S64, i.dims());
  Value end = runtime_size ? b.broadcast_in_dim(*runtime_size, i.dims(), {}) : b.constant_int(size, ElementType::S64, i.dims());
  Value shifted = b.binary("add", i, end);
  return b.select(b.compare(i, zero, hlo::Compare::LT), shifted, i);
}

// Full coordinates for element-wise gather/scatter: `index` along `dim`, the
// element's own position elsewhere. Shape index.dims + [rank].
Value coordinates(Builder& b, Value index, int64_t dim, int64_t rank) {
  Dims d = index.dims();
  Dims with_one = d;
  with_one.push_back(1);
  std::vector<Value> parts;
  for (int64_t k = 0; k < rank; ++k) {
    Value part = k == dim ? as_index(b, index) : b.iota(TensorType{ElementType::S64, d}, k);
    parts.push_back(b.reshape(part, with_one));
  }
  return b.concatenate(parts, static_cast<int64_t>(d.size()));
}

std::vector<Value> lower_gather(Context& c) {
  Value x = c.tensor("self"), index = c.tensor("index");
  int64_t rank = x.rank();
  int64_t dim = wrap_dim(c.int_arg("dim"), rank);
  check_dim_index(c, index, x, dim);
  if (rank == 0) return {x};
  Dims all = all_dims(rank);
  hlo::Builder::GatherDims dn{{}, all, {}, {}, all, rank};
  return {c.b.gather(x, coordinates(c.b, index, dim, rank), dn, Dims(rank, 1), index.dims())};
}

// scatter / scatter_add: src (or a Scalar value) written at index along dim.
std::vector<Value> scatter_like(Context& c, bool accumulate) {
  std::optional<hlo::Reducer> combine;  // scatter(..., reduce="add"/"multiply") combines with self
  if (accumulate) combine = hlo::Reducer::Add;
  if (c.has("reduce")) {
    std::string reduce = c.string_arg("reduce");
    if (reduce != "add" && reduce != "multiply") throw Unsupported("scatter with reduce=" + reduce);
    combine = reduce == "add" ? hlo::Reducer::Add : hlo::Reducer::Mul;
  }
  Value x = c.tensor("self"), index = c.tensor("index");
  if (index.type.element_count() == 0) return {x};
  check_dim_index(c, index, x, wrap_dim(c.int_arg("dim"), x.rank()));
  Dims result_dims = x.dims();
  if (x.rank() == 0) {  // a 0-d scatter is a 1-element one
    x = c.b.reshape(x, {1});
    index = c.b.reshape(index, {1});
  }
  int64_t rank = x.rank();
  int64_t dim = wrap_dim(c.int_arg("dim"), rank);
  Value updates;
  if (c.is_tensor("src")) {
    Value src = c.b.convert(c.tensor("src"), x.element());
    if (src.rank() == 0) src = c.b.reshape(src, {1});
    updates = c.b.slice(src, Dims(rank, 0), index.dims(), Dims(rank, 1));  // src may be larger than index
  } else {
    updates = c.b.broadcast_in_dim(c.scalar("value", x.element()), index.dims(), {});
  }
  Dims all = all_dims(rank);
  hlo::Builder::ScatterDims dn{{}, all, {}, {}, all, rank};
  return {c.b.reshape(c.b.scatter(x, coordinates(c.b, index, dim, rank), updates, dn, combine), result_dims)};
}

// "sum", "prod", "mean", "amax" or "amin" of the updates landing on each
// position of x (coords: full coordinates per update). Positions no update
// reaches keep x; with include_self=False the others start from the
// reduction's identity instead of x.
Value reduce_into(Builder& b, Value x, Value coords, Value updates, const std::string& reduce, bool include_self) {
  ElementType e = x.element();
  bool mean = reduce == "mean";
  if (e == ElementType::Pred) throw Unsupported("bool scatter reduction");
  if (mean && !is_float(e)) throw Unsupported("integer scatter mean");  // the CPU floors
  hlo::Reducer r = reduce == "sum" || mean ? hlo::Reducer::Add
                   : reduce == "prod"     ? hlo::Reducer::Mul
                   : reduce == "amax"     ? hlo::Reducer::Max
                   : reduce == "amin"     ? hlo::Reducer::Min
                                          : throw Unsupported("scatter reduction " + reduce);
  int64_t rank = x.rank();
  Dims all = all_dims(rank);
  hlo::Builder::ScatterDims dn{{}, all, {}, {}, all, rank};
  Value identity = b.broadcast_in_dim(init_for(b, r, e), x.dims(), {});
  Value combined = b.scatter(include_self ? x : identity, coords, updates, dn, r);
  if (include_self && !mean) return combined;
  Value ones = b.constant(1, e, updates.dims());
  Value counts = b.scatter(b.constant(0, e, x.dims()), coords, ones, dn, hlo::Reducer::Add);
  Value reached = b.compare(counts, full(b, 0, counts), hlo::Compare::GT);
  if (mean) combined = b.binary("divide", combined, include_self ? b.binary("add", counts, full(b, 1, counts)) : counts);
  return b.select(reached, combined, x);
}

bool include_self_arg(Context& c) { return !c.has("include_self") || c.bool_arg("include_self"); }

// scatter_reduce(self, dim, index, src, reduce, include_self)
std::vector<Value> lower_scatter_reduce(Context& c) {
  Value x = c.tensor("self"), index = c.tensor("index");
  if (x.rank() == 0 || index.type.element_count() == 0) throw Unsupported("scatter_reduce of a 0-d or empty index");
  int64_t rank = x.rank(), dim = wrap_dim(c.int_arg("dim"), rank);
  check_dim_index(c, index, x, dim);
  Value src = c.b.convert(c.tensor("src"), x.element());
  Value updates = c.b.slice(src, Dims(rank, 0), index.dims(), Dims(rank, 1));
  return {reduce_into(c.b, x, coordinates(c.b, index, dim, rank), updates, c.string_arg("reduce"), include_self_arg(c))};
}

// index_reduce(self, dim, index, source, reduce, include_self): slice i of
// source reduces into slice index[i] of self along dim.
std::vector<Value> lower_index_reduce(Context& c) {
  Value x = c.tensor("self"), index = c.tensor("index");
  Value source = c.b.convert(c.tensor("source"), x.element());
  if (x.rank() == 0 || source.rank() != x.rank() || index.type.element_count() == 0)
    throw Unsupported("index_reduce of a 0-d tensor or an empty index");
  int64_t rank = x.rank(), dim = wrap_dim(c.int_arg("dim"), rank);
  check_select_index(c, index, x.dims()[dim], dim);
  Value per_update = c.b.broadcast_in_dim(c.b.reshape(index, {index.type.element_count()}), source.dims(), {dim});
  return {reduce_into(c.b, x, coordinates(c.b, per_update, dim, rank), source, c.string_arg("reduce"),
                      include_self_arg(c))};
}

// index_copy(self, dim, index, source): slice i of source replaces slice
// index[i] of self along dim. With repeated indices the CPU's loop leaves the
// last copy: the other copies get an out-of-range index, which XLA's scatter
// skips. Few indices into a long dim (a KV cache's slots) compare pairwise, in
// proportion to n^2; otherwise a max-scatter of positions over the dim finds
// the last copy, in proportion to the dim's size.
std::vector<Value> lower_index_copy(Context& c) {
  Builder& b = c.b;
  Value x = c.tensor("self"), index = c.tensor("index");
  int64_t n = index.type.element_count();
  if (n == 0) return {x};
  Dims result_dims = x.dims();
  if (x.rank() == 0) x = b.reshape(x, {1});
  int64_t rank = x.rank(), dim = wrap_dim(c.int_arg("dim"), rank), size = x.dims()[dim];
  check_in_range(c, index, size, false, CheckError::Index,
                 "index_copy_(): index {} is out of bounds for dimension " + std::to_string(dim) + " with size " +
                     std::to_string(size));
  Dims update_dims = x.dims();
  update_dims[dim] = n;
  Value source = b.reshape(b.convert(c.tensor("source"), x.element()), update_dims);  // a 0-d source: one slice
  Value idx = b.reshape(as_index(b, index), {n, 1});
  Value positions = b.iota(TensorType{ElementType::S64, {n}}, 0);
  Value kept;
  if (n <= 4096 && n * n < size) {
    // kept[i]: no j > i writes the same slice
    const Dims pairs{n, n};
    Value flat = b.reshape(idx, {n});
    Value same = b.compare(b.broadcast_in_dim(flat, pairs, {0}), b.broadcast_in_dim(flat, pairs, {1}), hlo::Compare::EQ);
    Value later = b.compare(b.iota(TensorType{ElementType::S64, pairs}, 1), b.iota(TensorType{ElementType::S64, pairs}, 0),
                            hlo::Compare::GT);
    Value overwritten = b.reduce(b.binary("and", same, later), b.constant_bool(false), {1}, hlo::Reducer::Or);
    kept = b.unary("not", overwritten);
  } else {
    hlo::Builder::ScatterDims by_slot{{}, {0}, {}, {}, {0}, 1};
    Value last = b.scatter(b.constant_int(-1, ElementType::S64, {size}), idx, positions, by_slot, hlo::Reducer::Max);
    hlo::Builder::GatherDims from_slot{{}, {0}, {}, {}, {0}, 1};
    kept = b.compare(b.gather(last, idx, from_slot, {1}, {n}), positions, hlo::Compare::EQ);
  }
  Value target = b.select(b.reshape(kept, {n, 1}), idx, b.constant_int(size, ElementType::S64, {n, 1}));
  Dims window;
  for (int64_t d = 0; d < rank; ++d)
    if (d != dim) window.push_back(d);
  hlo::Builder::ScatterDims dn{window, {dim}, {}, {}, {dim}, 1};
  return {b.reshape(b.scatter(x, target, source, dn, std::nullopt), result_dims)};
}

std::vector<Value> lower_scatter(Context& c) { return scatter_like(c, false); }
std::vector<Value> lower_scatter_add(Context& c) { return scatter_like(c, true); }

std::vector<Value> lower_index_select(Context& c) {
  Value x = c.tensor("self");
  Value index = c.tensor("index");
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  check_index_select(c, index, x, dim);
  if (x.rank() == 0) return {x};
  int64_t n = index.type.element_count();
  index = as_index(c.b, c.b.reshape(index, {n}));
  Dims offset, slice = x.dims(), out = x.dims();
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) offset.push_back(d);
  slice[dim] = 1;
  out[dim] = n;
  hlo::Builder::GatherDims dn{offset, {dim}, {}, {}, {dim}, 1};
  return {c.b.gather(x, index, dn, slice, out)};
}

// Advanced indexing, as a gather over the operand transposed so that the
// indexed dims come first. Result layout follows NumPy: the broadcast index
// dims replace the indexed dims in place when those are adjacent, else lead.
struct IndexPlan {
  Dims order;       // operand dims: indexed ones first, then the rest
  Dims rest_sizes;  // sizes of the non-indexed dims, in order
  Dims batch;       // broadcast shape of the index tensors
  Value coords;     // batch + [indexed count]
  int64_t k = 0;    // how many dims are indexed
  int64_t place = 0;  // where the batch dims go in the result
};

// Index d may count from the end (-size..size-1); outside that the CPU
// raises IndexError.
IndexPlan plan_index(Context& c, const Value& x, const std::vector<std::optional<Value>>& indices) {
  Builder& b = c.b;
  IndexPlan p;
  Dims indexed, rest;
  for (int64_t d = 0; d < x.rank(); ++d) {
    bool has = d < static_cast<int64_t>(indices.size()) && indices[d];
    if (has) {
      ElementType e = indices[d]->element();
      if (e == ElementType::Pred || e == ElementType::U8) throw Unsupported("a boolean mask index (data-dependent shape)");
      indexed.push_back(d);
      p.batch = broadcast_shape(p.batch, indices[d]->dims());
    } else {
      rest.push_back(d);
      p.rest_sizes.push_back(x.dims()[d]);
    }
  }
  if (indexed.empty()) throw Unsupported("indexing without index tensors");
  p.k = static_cast<int64_t>(indexed.size());
  bool adjacent = indexed.back() - indexed.front() + 1 == p.k;
  p.place = adjacent ? indexed.front() : 0;
  p.order = indexed;
  p.order.insert(p.order.end(), rest.begin(), rest.end());
  Dims with_one = p.batch;
  with_one.push_back(1);
  std::vector<Value> parts;
  for (size_t k = 0; k < indexed.size(); ++k) {
    int64_t d = indexed[k];
    // CPU's message numbers the indexed dims only (x[:, i] reports dimension 0).
    std::optional<Value> runtime_size = c.runtime_size("self", d);  // a mask growing per token
    std::string message = runtime_size ? out_of_bounds(static_cast<int64_t>(k), "{size}")
                                       : out_of_bounds(static_cast<int64_t>(k), x.dims()[d]);
    check_in_range(c, *indices[d], x.dims()[d], true, CheckError::Index, message, runtime_size);
    Value i = broadcast_to(b, wrap_negative(b, as_index(b, *indices[d]), x.dims()[d], runtime_size), p.batch);
    parts.push_back(b.reshape(i, with_one));
  }
  p.coords = b.concatenate(parts, static_cast<int64_t>(p.batch.size()));
  return p;
}

// The permutation from gather order [batch..., rest...] to the result order.
Dims result_permutation(const IndexPlan& p) {
  int64_t nb = static_cast<int64_t>(p.batch.size()), nr = static_cast<int64_t>(p.rest_sizes.size());
  Dims perm;
  for (int64_t i = 0; i < p.place; ++i) perm.push_back(nb + i);
  for (int64_t i = 0; i < nb; ++i) perm.push_back(i);
  for (int64_t i = p.place; i < nr; ++i) perm.push_back(nb + i);
  return perm;
}

Dims inverse(const Dims& perm) {
  Dims inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

Dims range(int64_t from, int64_t count) {
  Dims d;
  for (int64_t i = 0; i < count; ++i) d.push_back(from + i);
  return d;
}

std::vector<Value> lower_index(Context& c) {
  Value x = c.tensor("self");
  IndexPlan p = plan_index(c, x, c.tensor_list("indices"));
  int64_t nb = static_cast<int64_t>(p.batch.size()), nr = static_cast<int64_t>(p.rest_sizes.size());
  Value xt = c.b.transpose(x, p.order);
  Dims slice(p.k, 1), out = p.batch;
  slice.insert(slice.end(), p.rest_sizes.begin(), p.rest_sizes.end());
  out.insert(out.end(), p.rest_sizes.begin(), p.rest_sizes.end());
  hlo::Builder::GatherDims dn{range(nb, nr), range(0, p.k), {}, {}, range(0, p.k), nb};
  return {c.b.transpose(c.b.gather(xt, p.coords, dn, slice, out), result_permutation(p))};
}

// index_put_(self, indices, values, accumulate): the transposed scatter.
std::vector<Value> lower_index_put(Context& c) {
  Value x = c.tensor("self");
  IndexPlan p = plan_index(c, x, c.tensor_list("indices"));
  int64_t nb = static_cast<int64_t>(p.batch.size()), nr = static_cast<int64_t>(p.rest_sizes.size());
  Dims perm = result_permutation(p), gathered = p.batch, result;
  gathered.insert(gathered.end(), p.rest_sizes.begin(), p.rest_sizes.end());
  for (int64_t d : perm) result.push_back(gathered[d]);
  Value values = to(c.b, c.tensor("values"), x.element(), result);
  Value updates = c.b.transpose(values, inverse(perm));
  hlo::Builder::ScatterDims dn{range(nb, nr), range(0, p.k), {}, {}, range(0, p.k), nb};
  bool accumulate = c.has("accumulate") && c.bool_arg("accumulate");
  Value xt = c.b.scatter(c.b.transpose(x, p.order), p.coords, updates, dn,
                         accumulate ? std::optional(hlo::Reducer::Add) : std::nullopt);
  return {c.b.transpose(xt, inverse(p.order))};
}

std::vector<Value> lower_embedding_dense_backward(Context& c) {
  if (c.bool_arg("scale_grad_by_freq")) throw Unsupported("scale_grad_by_freq=True");
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value g = c.b.convert(c.tensor("grad_output"), e);
  Value idx = as_index(c.b, c.tensor("indices"));
  int64_t n = idx.type.element_count(), width = o.dims.back();
  g = c.b.reshape(g, {n, width});
  idx = c.b.reshape(idx, {n});
  Value padding = c.b.constant_int(c.int_arg("padding_idx"), ElementType::S64, {n});
  Value keep = c.b.broadcast_in_dim(c.b.compare(idx, padding, hlo::Compare::NE), {n, width}, {0});
  g = c.b.select(keep, g, zeros_like(c.b, g));
  hlo::Builder::ScatterDims dn{{1}, {0}, {}, {}, {0}, 1};
  return {c.b.scatter(c.b.constant(0, e, o.dims), c.b.reshape(idx, {n, 1}), g, dn, hlo::Reducer::Add)};
}

}  // namespace

void register_indexing(Table& t) {
  add_lowerings(t, {
           {"gather", lower_gather, kComplex}, {"scatter", lower_scatter, kComplex}, {"scatter_add", lower_scatter_add, kComplex},
           {"scatter_reduce", lower_scatter_reduce}, {"index_reduce", lower_index_reduce},
           {"index_select", lower_index_select, kComplex}, {"index", lower_index, kComplex}, {"_index_put_impl", lower_index_put, kComplex},
           {"index_put", lower_index_put, kComplex}, {"index_copy", lower_index_copy}, {"embedding_dense_backward", lower_embedding_dense_backward}});
  rule(t, "index").length_padding(0).cpu(kHostIndices);  // padded index lanes read element 0; checks use the runtime size
  for (const char* name : {"index_put", "_index_put_impl"})
    rule(t, name).cpu(kIndexPutValues | kHostIndices).internal_overlap_ok().no_aliasing();
  // Index kernels reject even full aliasing of their output with an input (at::assert_no_overlap): an out=
  // the very tensor they read would be read while written. gather: with `self` only.
  for (const char* name : {"index_copy", "scatter", "scatter_add", "scatter_reduce", "index_reduce", "index_select"})
    rule(t, name).no_aliasing();
  rule(t, "gather").no_aliasing_with({"self"});
  // Not lowered (they run on the CPU); the CPU writes an overlapping output of a constant fill.
  rule(t, "index_fill").internal_overlap_ok().inputs_overlap_unchecked();
  rule(t, "masked_scatter").inputs_overlap_unchecked();
  // Data-dependent result shapes: device kernels in _data_dependent.py, not torch._decomp's.
  for (const char* name : {"nonzero", "unique", "masked_select"}) rule(t, name).skip_decomposition();
}

}  // namespace torch_pjrt::lowering
