// Ops a mixture-of-experts layer routes tokens with: index_add (the experts'
// outputs summed back per token), histc (tokens per expert), repeat_interleave
// (each row's expert id, repeated by its count) and torch._grouped_mm (every
// expert's matmul over its rows in one op).
#include <cmath>
#include <string>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// index_add(self, dim, index, source, alpha): slice i of source (times alpha)
// is added into slice index[i] of self along dim.
std::vector<Value> lower_index_add(Context& c) {
  Builder& b = c.b;
  Value x = c.tensor("self"), index = c.tensor("index"), source = c.tensor("source");
  Dims result_dims = x.dims();
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  if (x.rank() == 0) x = b.reshape(x, {1});
  if (source.rank() == 0) source = b.reshape(source, {1});
  int64_t n = index.type.element_count(), size = x.dims()[dim];
  if (source.rank() != x.rank() || source.dims()[dim] != n) throw Unsupported("index_add: source does not match index");
  // The CPU's errors: its 1-d kernel raises IndexError, the scatter-based one RuntimeError.
  if (x.rank() == 1)
    check_in_range(c, index, size, false, CheckError::Index, "index out of range in self");
  else
    check_in_range(c, index, size, false, CheckError::Runtime,
                   "index {} is out of bounds for dimension " + std::to_string(dim) + " with size " + std::to_string(size));
  if (n == 0) return {b.reshape(x, result_dims)};
  ElementType e = x.element();
  Value updates = b.convert(source, e);
  if (c.has("alpha")) {
    Value alpha = b.broadcast_in_dim(c.scalar("alpha", e), updates.dims(), {});
    updates = b.binary(e == ElementType::Pred ? "and" : "multiply", updates, alpha);
  }
  Dims window;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) window.push_back(d);
  hlo::Builder::ScatterDims dn{window, {dim}, {}, {}, {dim}, 1};
  Value indices = b.reshape(b.convert(index, ElementType::S64), {n, 1});
  return {b.reshape(b.scatter(x, indices, updates, dn, hlo::Reducer::Add), result_dims)};
}

// histc(self, bins, min, max). Floats as the CPU kernel computes them:
// bin = (x - min) * bins / (max - min) in the input's dtype, max itself in the
// last bin, values outside [min, max] (and NaN) ignored; min == max takes the
// data's range (widened by 1 on each side when it is one value). Integers,
// which the CPU kernel rejects, follow CUDA: the same in int64 arithmetic.
std::vector<Value> lower_histc(Context& c) {
  Builder& b = c.b;
  Value x = c.tensor("self");
  int64_t bins = c.int_arg("bins");
  if (bins <= 0) throw Unsupported("histc with bins <= 0");  // the CPU raises
  ElementType out = c.output(0).element;
  bool floating = is_float(x.element());
  ElementType e = floating ? x.element() : ElementType::S64;  // f16 too: the CPU rounds each step to half
  int64_t n = x.type.element_count();
  if (n == 0) return {b.constant(0, out, {bins})};
  Value v = b.convert(b.reshape(x, {n}), e);
  double lo = c.scalar_value("min"), hi = c.scalar_value("max");
  Value left, right;
  if (lo != hi) {
    if (!(lo < hi) || !std::isfinite(lo) || !std::isfinite(hi)) throw Unsupported("histc range");  // the CPU raises
    if (!floating) lo = std::trunc(lo), hi = std::trunc(hi);  // min.to<input_t>()
    left = b.constant(lo, e);
    right = b.constant(hi, e);
  } else {
    left = b.reduce(v, highest(b, e), {0}, hlo::Reducer::Min);
    right = b.reduce(v, lowest(b, e), {0}, hlo::Reducer::Max);
    if (floating) {
      auto is_finite = [&](const Value& s) { return b.compare(b.unary("abs", s), b.constant(INFINITY, e), hlo::Compare::LT); };
      Value finite = b.binary("and", is_finite(left), is_finite(right));  // false for NaN too
      c.check(RuntimeCheck{finite, b.constant_int(0, ElementType::S64), CheckError::Runtime,
                           "torch.histc: range of [min, max] of the input is not finite"});
    }
    Value same = b.compare(left, right, hlo::Compare::EQ);
    left = b.select(same, b.binary("subtract", left, b.constant(1, e)), left);
    right = b.select(same, b.binary("add", right, b.constant(1, e)), right);
  }
  auto splat = [&](const Value& s) { return b.broadcast_in_dim(s, {n}, {}); };
  Value inside = b.binary("and", b.compare(v, splat(left), hlo::Compare::GE), b.compare(v, splat(right), hlo::Compare::LE));
  Value scaled = b.binary("divide", b.binary("multiply", b.binary("subtract", v, splat(left)), b.constant(bins, e, {n})),
                          splat(b.binary("subtract", right, left)));
  Value pos = b.convert(floating ? b.select(inside, scaled, b.constant(0, e, {n})) : scaled, ElementType::S64);
  Value last = b.constant_int(bins - 1, ElementType::S64, {n});
  pos = b.clamp(b.constant_int(0, ElementType::S64, {n}), pos, last);  // max itself lands in the last bin
  ElementType count_type = is_float(out) ? widen(out) : ElementType::S64;
  Value ones = b.convert(inside, count_type);
  hlo::Builder::ScatterDims dn{{}, {0}, {}, {}, {0}, 1};
  Value counts = b.scatter(b.constant(0, count_type, {bins}), b.reshape(pos, {n, 1}), ones, dn, hlo::Reducer::Add);
  return {counts};
}

// A row (or column) position's group: how many group ends offs[g] lie at or
// before it. s64[count]; `groups` for positions past the last end.
Value group_of(Builder& b, const Value& offs, int64_t count) {
  int64_t groups = offs.type.element_count();
  Value ends = b.broadcast_in_dim(b.convert(b.reshape(offs, {groups}), ElementType::S64), {count, groups}, {1});
  Value pos = b.iota(TensorType{ElementType::S64, {count, groups}}, 0);
  Value past = b.convert(b.compare(pos, ends, hlo::Compare::GE), ElementType::S64);
  return b.reduce(past, b.constant_int(0, ElementType::S64), {1}, hlo::Reducer::Add);
}

// [count, groups] mask: position p belongs to group g.
Value group_mask(Builder& b, const Value& offs, int64_t count) {
  int64_t groups = offs.type.element_count();
  Value g = b.broadcast_in_dim(group_of(b, offs, count), {count, groups}, {0});
  return b.compare(g, b.iota(TensorType{ElementType::S64, {count, groups}}, 1), hlo::Compare::EQ);
}

// torch._grouped_mm(self, mat2, offs, bias, out_dtype): per group g, the rows
// (2d x 3d), columns (3d x 2d) or contraction range (2d x 2d) of group g, as
// cut by the cumulative ends in offs, times that group's matrix; 3d x 3d is a
// batched matmul. Each group's product is computed over all positions and
// masked (no data-dependent shapes). Positions past offs[-1], which the CPU
// leaves uninitialized, are zero.
std::vector<Value> lower_grouped_mm(Context& c) {
  Builder& b = c.b;
  if (c.has("bias")) throw Unsupported("_grouped_mm with bias");
  ElementType out = c.output(0).element, e = widen(out);
  Value a = b.convert(c.tensor("self"), e), w = b.convert(c.tensor("mat2"), e);
  bool has_offs = c.has("offs");
  Value zero = b.constant(0, e);
  auto masked_sum = [&](Value per_group, const Value& mask, int64_t group_dim) {
    // per_group has the group dim at group_dim; mask broadcasts over it.
    return b.reduce(b.select(mask, per_group, b.broadcast_in_dim(zero, per_group.dims(), {})), zero, {group_dim},
                    hlo::Reducer::Add);
  };
  if (a.rank() == 3 && w.rank() == 3) {
    if (has_offs) throw Unsupported("_grouped_mm 3d x 3d with offs");
    return {b.dot_general(a, w, {0}, {0}, {2}, {1}, e)};
  }
  if (!has_offs) throw Unsupported("_grouped_mm without offs");
  Value offs = c.tensor("offs");
  int64_t groups = offs.type.element_count();
  if (a.rank() == 2 && w.rank() == 3) {  // [M, K] x [G, K, N] -> [M, N], rows grouped
    int64_t m = a.dims()[0], n = w.dims()[2];
    Value y = b.dot_general(a, w, {}, {}, {1}, {1}, e);  // [M, G, N]
    Value mask = b.broadcast_in_dim(group_mask(b, offs, m), {m, groups, n}, {0, 1});
    return {masked_sum(y, mask, 1)};
  }
  if (a.rank() == 3 && w.rank() == 2) {  // [G, M, K] x [K, N] -> [M, N], columns grouped
    int64_t m = a.dims()[1], n = w.dims()[1];
    Value y = b.dot_general(a, w, {}, {}, {2}, {0}, e);  // [G, M, N]
    Value mask = b.broadcast_in_dim(b.transpose(group_mask(b, offs, n), {1, 0}), {groups, m, n}, {0, 2});
    return {masked_sum(y, mask, 0)};
  }
  if (a.rank() == 2 && w.rank() == 2) {  // [M, K] x [K, N] -> [G, M, N], contraction grouped
    int64_t m = a.dims()[0], k = a.dims()[1];
    Value mask = b.broadcast_in_dim(b.transpose(group_mask(b, offs, k), {1, 0}), {groups, m, k}, {0, 2});
    Value ga = b.broadcast_in_dim(a, {groups, m, k}, {1, 2});
    ga = b.select(mask, ga, b.broadcast_in_dim(zero, ga.dims(), {}));
    return {b.dot_general(ga, w, {}, {}, {2}, {0}, e)};
  }
  throw Unsupported("_grouped_mm of these ranks");
}

}  // namespace

// repeat_interleave.Tensor(repeats, output_size): i repeated repeats[i] times.
// Only with output_size, the result's length (torchtitan's MoE passes it);
// without it the length is data and the op runs on the CPU. Element j is the
// number of rows that end at or before j: ends = cumsum(repeats).
std::vector<Value> lower_repeat_interleave(Context& c) {
  Builder& b = c.b;
  if (!c.has("output_size")) throw Unsupported("repeat_interleave without output_size: its length is data");
  Value repeats = c.tensor("repeats");
  if (repeats.rank() != 1 || repeats.dims()[0] == 0) throw Unsupported("repeat_interleave: repeats not a 1-D list");
  const int64_t n = repeats.dims()[0], total = c.int_arg("output_size");
  const ElementType s64 = ElementType::S64;
  Value r = b.convert(repeats, s64);
  Value zero = b.constant_int(0, s64);
  Value upto = b.compare(b.iota(TensorType{s64, {n, n}}, 1), b.iota(TensorType{s64, {n, n}}, 0), hlo::Compare::LE);
  Value ends = b.reduce(b.select(upto, b.broadcast_in_dim(r, {n, n}, {1}), b.constant_int(0, s64, {n, n})), zero, {1},
                        hlo::Reducer::Add);
  // The CPU raises unless the repeats add up to output_size exactly.
  Value needed = b.reshape(b.slice(ends, {n - 1}, {n}, {1}), {});
  c.check(RuntimeCheck{b.compare(needed, b.constant_int(total, s64), hlo::Compare::EQ), needed, CheckError::Runtime,
                       "allocated size does not match required size"});
  if (total == 0) return {b.constant_int(0, c.output(0).element, {0})};
  Value ended = b.compare(b.broadcast_in_dim(ends, {total, n}, {1}), b.iota(TensorType{s64, {total, n}}, 0),
                          hlo::Compare::LE);
  Value index = b.reduce(b.convert(ended, s64), zero, {1}, hlo::Reducer::Add);
  return {b.convert(index, c.output(0).element)};
}

void register_moe(Table& t) {
  // Its CPU errors depend on the values (checked on the device): CUDA's dtypes are the CPU's, and the
  // stand-in probe of integer inputs (kCudaDtypes turns it off) would only find a wrong sum.
  add_lowering(t, "repeat_interleave.Tensor", lower_repeat_interleave).cpu(kCudaDtypes);
  add_lowering(t, "index_add", lower_index_add).no_aliasing();
  // min/max decide the bins' edges; integer inputs follow CUDA, which the CPU kernel lacks.
  add_lowering(t, "histc", lower_histc, /*bake_scalars=*/true).cpu(kCudaDtypes);
  add_lowering(t, "_grouped_mm", lower_grouped_mm);
}

}  // namespace torch_pjrt::lowering
