// Reductions: sum/mean/prod, amax/amin, max/min (with indices), argmax/argmin,
// var/std (and their _mean forms), any/all, logsumexp, norms, cumulative ops.
// Each reduces in the output's dtype (widened for f16/bf16, as PyTorch
// accumulates) and reshapes to the meta kernel's output shape, which covers
// keepdim.
#include <algorithm>
#include <limits>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

using hlo::Compare;
using hlo::Reducer;

// B (the "cpu" platform's rules, register_reduction): XLA:CPU turns a reduction over more than 32 elements into a chain of reduce-windows of 32 (a pairwise
// tree, for precision), and nothing fuses into a reduce-window: the producer of a large reduction was
// materialized whole (sum of 2^31 uint8 wrote a 16 GiB int64 copy of the input; a norm wrote x*x). A large
// reduction over trailing dims takes the tree's first level here, a plain reduce over blocks of 32 that
// the producer fuses into, behind a barrier (XLA would merge the two reduces back); XLA builds the rest of
// the same tree on the 32x smaller partial results. Other platforms' compilers fuse a plain reduce
// (GPU, TPU): the generic rules reduce in one op.
constexpr int64_t kTreeBlock = 32;
constexpr int64_t kTreeFrom = int64_t{1} << 20;  // elements; below this a copy costs little
template <bool B>
Value reduce(Builder& b, Value x, const Dims& dims, Reducer r) {
  Value init = init_for(b, r, x.element());
  Dims sorted = dims;
  std::sort(sorted.begin(), sorted.end());
  const int64_t kept_rank = x.rank() - static_cast<int64_t>(sorted.size());
  bool trailing = !sorted.empty();
  for (size_t i = 0; i < sorted.size(); ++i) trailing &= sorted[i] == kept_rank + static_cast<int64_t>(i);
  if (!B || !trailing || x.type.element_count() < kTreeFrom) return b.reduce(x, init, dims, r);
  Dims shape(x.dims().begin(), x.dims().begin() + kept_rank);
  int64_t n = 1;
  for (int64_t d : sorted) n *= x.dims()[d];
  if (n <= kTreeBlock) return b.reduce(x, init, dims, r);
  shape.push_back(n);
  Value v = b.reshape(x, shape);
  const int64_t padded = (n + kTreeBlock - 1) / kTreeBlock * kTreeBlock;
  if (padded != n) {  // the tail block is filled with the reducer's identity, as XLA pads
    Dims low(shape.size(), 0), high(shape.size(), 0), interior(shape.size(), 0);
    high[kept_rank] = padded - n;
    v = b.pad(v, init, low, high, interior);
  }
  Dims blocks = shape;
  blocks[kept_rank] = padded / kTreeBlock;
  blocks.push_back(kTreeBlock);
  Value partial = b.unary("optimization_barrier", b.reduce(b.reshape(v, blocks), init, {kept_rank + 1}, r));
  return b.reduce(partial, init, {kept_rank}, r);
}

int64_t count_over(const Value& x, const Dims& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= x.dims()[d];
  return n;
}

// `self` converted to the dtype the reduction runs in.
Value input_as(Context& c, ElementType e) { return c.b.convert(c.tensor("self"), e); }

template <bool B>
std::vector<Value> sum_like(Context& c, Reducer r) {
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value x = input_as(c, e);
  Dims dims = reduce_dims(c, "dim", x.rank());
  return {c.b.reshape(reduce<B>(c.b, x, dims, r), o.dims)};
}
template <bool B>
std::vector<Value> lower_sum(Context& c) { return sum_like<B>(c, Reducer::Add); }
template <bool B>
std::vector<Value> lower_prod(Context& c) { return sum_like<B>(c, Reducer::Mul); }
template <bool B>
std::vector<Value> lower_amax(Context& c) { return sum_like<B>(c, Reducer::Max); }
template <bool B>
std::vector<Value> lower_amin(Context& c) { return sum_like<B>(c, Reducer::Min); }
template <bool B>
std::vector<Value> lower_nansum(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = input_as(c, widen(o.element));
  if (is_float(x.element())) x = c.b.select(c.b.compare(x, x, Compare::NE), full(c.b, 0, x), x);
  return {c.b.reshape(reduce<B>(c.b, x, reduce_dims(c, "dim", x.rank()), Reducer::Add), o.dims)};
}

template <bool B>
std::vector<Value> lower_mean(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = input_as(c, widen(o.element));
  Dims dims = reduce_dims(c, "dim", x.rank());
  Value s = reduce<B>(c.b, x, dims, Reducer::Add);
  return {c.b.reshape(c.b.binary("divide", s, full(c.b, static_cast<double>(count_over(x, dims)), s)), o.dims)};
}

template <bool B>
std::vector<Value> any_all(Context& c, Reducer r) {
  const OutputMeta& o = c.output(0);
  Value x = input_as(c, ElementType::Pred);
  return {c.b.reshape(reduce<B>(c.b, x, reduce_dims(c, "dim", x.rank()), r), o.dims)};
}
template <bool B>
std::vector<Value> lower_any(Context& c) { return any_all<B>(c, Reducer::Or); }
template <bool B>
std::vector<Value> lower_all(Context& c) { return any_all<B>(c, Reducer::And); }

// max/min: the full reduction, the (values, indices) form along a dim, or
// the elementwise binary form (max.other).
template <bool B>
std::vector<Value> max_min(Context& c, bool is_max) {
  if (c.is_tensor("other")) {
    const OutputMeta& o = c.output(0);
    return {c.b.binary(is_max ? "maximum" : "minimum", to(c.b, c.tensor("self"), o.element, o.dims),
                       to(c.b, c.tensor("other"), o.element, o.dims))};
  }
  Value x = c.tensor("self");
  if (!c.has("dim")) return {c.b.reshape(reduce<B>(c.b, x, all_dims(x.rank()), is_max ? Reducer::Max : Reducer::Min), {})};
  if (x.rank() == 0) x = c.b.reshape(x, {1});
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  Value idx = c.b.iota(TensorType{ElementType::S64, x.dims()}, dim);
  auto r = c.b.reduce_arg(x, idx, dim, is_max);
  return {c.b.reshape(r[0], c.output(0).dims), c.b.reshape(r[1], c.output(1).dims)};
}
template <bool B>
std::vector<Value> lower_max(Context& c) { return max_min<B>(c, true); }
template <bool B>
std::vector<Value> lower_min(Context& c) { return max_min<B>(c, false); }

std::vector<Value> arg_max_min(Context& c, bool is_max) {
  Value x = c.tensor("self");
  if (x.element() == ElementType::Pred) throw Unsupported("argmax/argmin of bool");  // the CPU raises
  int64_t dim = 0;
  if (c.has("dim")) {
    if (x.rank() == 0) x = c.b.reshape(x, {1});
    dim = wrap_dim(c.int_arg("dim"), x.rank());
  } else {
    x = c.b.reshape(x, {x.type.element_count()});
  }
  Value idx = c.b.iota(TensorType{ElementType::S64, x.dims()}, dim);
  return {c.b.reshape(c.b.reduce_arg(x, idx, dim, is_max)[1], c.output(0).dims)};
}
std::vector<Value> lower_argmax(Context& c) { return arg_max_min(c, true); }
std::vector<Value> lower_argmin(Context& c) { return arg_max_min(c, false); }

// Two-pass variance: mean first, then the mean squared deviation.
struct Moments {
  Value var, mean;
};
template <bool B>
Moments moments(Context& c, ElementType e) {
  Value x = input_as(c, e);
  Dims dims = reduce_dims(c, "dim", x.rank());
  int64_t n = count_over(x, dims);
  Value total = reduce<B>(c.b, x, dims, Reducer::Add);
  Value mean = c.b.binary("divide", total, full(c.b, static_cast<double>(n), total));
  Dims kept;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) kept.push_back(d);
  Value centered = c.b.binary("subtract", x, c.b.broadcast_in_dim(mean, x.dims(), kept));
  Value ss = reduce<B>(c.b, c.b.binary("multiply", centered, centered), dims, Reducer::Add);
  Value correction = c.has("correction") ? c.scalar("correction", e)
                     : c.has("unbiased") ? c.b.constant(c.bool_arg("unbiased") ? 1 : 0, e)
                                         : c.b.constant(1, e);
  Value divisor = c.b.binary("maximum", c.b.binary("subtract", c.b.constant(static_cast<double>(n), e), correction),
                             c.b.constant(0, e));
  return {c.b.binary("divide", ss, c.b.broadcast_in_dim(divisor, ss.dims(), {})), mean};
}
template <bool B>
std::vector<Value> lower_var(Context& c) {
  return {c.b.reshape(moments<B>(c, widen(c.output(0).element)).var, c.output(0).dims)};
}
template <bool B>
std::vector<Value> lower_std(Context& c) {
  return {c.b.reshape(c.b.unary("sqrt", moments<B>(c, widen(c.output(0).element)).var), c.output(0).dims)};
}
template <bool B>
std::vector<Value> lower_var_mean(Context& c) {
  Moments m = moments<B>(c, widen(c.output(0).element));
  return {c.b.reshape(m.var, c.output(0).dims), c.b.reshape(m.mean, c.output(1).dims)};
}
template <bool B>
std::vector<Value> lower_std_mean(Context& c) {
  Moments m = moments<B>(c, widen(c.output(0).element));
  return {c.b.reshape(c.b.unary("sqrt", m.var), c.output(0).dims), c.b.reshape(m.mean, c.output(1).dims)};
}

template <bool B>
std::vector<Value> lower_logsumexp(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = input_as(c, widen(o.element));
  Dims dims = reduce_dims(c, "dim", x.rank());
  Dims kept;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) kept.push_back(d);
  Value m = reduce<B>(c.b, x, dims, Reducer::Max);
  // An infinite max would turn x - m into NaN: shift by 0 there instead.
  Value finite = c.b.compare(c.b.unary("abs", m), full(c.b, INFINITY, m), Compare::NE);
  Value shift = c.b.select(finite, m, full(c.b, 0, m));
  Value e = c.b.unary("exponential", c.b.binary("subtract", x, c.b.broadcast_in_dim(shift, x.dims(), kept)));
  Value r = c.b.binary("add", c.b.unary("log", reduce<B>(c.b, e, dims, Reducer::Add)), shift);
  return {c.b.reshape(r, o.dims)};
}

// ord is baked (bake_scalars): it picks the formula.
template <bool B>
std::vector<Value> lower_linalg_vector_norm(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value in = c.tensor("self");  // a complex input's norm is over its magnitudes
  Value x = is_complex(in.element()) ? c.b.convert(c.b.unary("abs", in), e) : c.b.unary("abs", c.b.convert(in, e));
  Dims dims = reduce_dims(c, "dim", x.rank());
  double ord = c.scalar_value("ord");
  Value r;
  if (std::isinf(ord)) {
    r = reduce<B>(c.b, x, dims, ord > 0 ? Reducer::Max : Reducer::Min);
  } else if (ord == 0) {
    r = reduce<B>(c.b, c.b.convert(c.b.compare(x, full(c.b, 0, x), Compare::NE), e), dims, Reducer::Add);
  } else if (ord == 1) {
    r = reduce<B>(c.b, x, dims, Reducer::Add);
  } else if (ord == 2) {
    r = c.b.unary("sqrt", reduce<B>(c.b, c.b.binary("multiply", x, x), dims, Reducer::Add));
  } else {
    Value s = reduce<B>(c.b, c.b.binary("power", x, full(c.b, ord, x)), dims, Reducer::Add);
    r = c.b.binary("power", s, full(c.b, 1.0 / ord, s));
  }
  return {c.b.reshape(r, o.dims)};
}

// Cumulative ops as a reduce_window whose window covers every earlier element.
std::vector<Value> cumulative(Context& c, Reducer r) {
  const OutputMeta& o = c.output(0);
  Value x = input_as(c, widen(o.element));
  if (x.rank() == 0) return {x};
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  int64_t n = x.dims()[dim];
  Dims window(x.rank(), 1), strides(x.rank(), 1), low(x.rank(), 0), high(x.rank(), 0);
  window[dim] = n;
  low[dim] = n - 1;
  return {c.b.reduce_window(x, init_for(c.b, r, x.element()), r, window, strides, low, high)};
}
std::vector<Value> lower_cumsum(Context& c) { return cumulative(c, Reducer::Add); }
std::vector<Value> lower_cumprod(Context& c) { return cumulative(c, Reducer::Mul); }
template <bool B>
std::vector<Value> lower_count_nonzero(Context& c) {
  Value x = c.tensor("self");
  Value nz = c.b.convert(c.b.compare(x, c.b.constant(0, x.element(), x.dims()), Compare::NE), ElementType::S64);
  return {c.b.reshape(reduce<B>(c.b, nz, reduce_dims(c, "dim", x.rank()), Reducer::Add), c.output(0).dims)};
}

// ---- order statistics: kthvalue, median, nanmedian ----

// The k-th smallest along `dim` (k: S64 per row, rows = x without `dim`) and
// its index. NaNs sort last (every NaN made positive first, since total order
// puts negative NaNs first); the sort is stable, so ties keep input order.
template <bool B>
std::pair<Value, Value> kth_smallest(Builder& b, Value x, int64_t dim, Value k) {
  if (is_float(x.element())) x = b.select(b.compare(x, x, Compare::NE), full(b, NAN, x), x);
  Value idx = b.iota(TensorType{ElementType::S64, x.dims()}, dim);
  std::vector<Value> sorted = b.sort({x, idx}, dim, /*descending=*/false);
  Dims rows = all_dims(x.rank());
  rows.erase(rows.begin() + dim);
  Value hit = b.compare(idx, b.broadcast_in_dim(k, x.dims(), rows), Compare::EQ);
  // One hit per row: a sum of the hit and zeros picks it (NaN and inf too); -0.0 for floats, so that a
  // -0.0 hit keeps its sign (-0 + +0 would be +0).
  Value zero = b.constant(is_float(x.element()) ? -0.0 : 0.0, x.element(), x.dims());
  Value value = b.reduce(b.select(hit, sorted[0], zero), b.constant(is_float(x.element()) ? -0.0 : 0.0, x.element()),
                         {dim}, Reducer::Add);
  Value index = reduce<B>(b, b.select(hit, sorted[1], b.constant_int(0, ElementType::S64, x.dims())), {dim}, Reducer::Add);
  return {value, index};
}

// median / nanmedian (lower median) and kthvalue, with or without `dim`.
template <bool B>
std::vector<Value> order_statistic(Context& c, std::string_view op) {
  Value x = c.tensor("self");
  bool with_dim = c.has("dim");
  if (!with_dim || x.rank() == 0) x = c.b.reshape(x, {x.type.element_count()});
  int64_t dim = with_dim && x.rank() > 0 ? wrap_dim(c.int_arg("dim"), x.rank()) : 0;
  int64_t n = x.dims()[dim];
  if (n == 0) throw Unsupported("order statistic of an empty dim");
  Dims row_dims = x.dims();
  row_dims.erase(row_dims.begin() + dim);
  const ElementType i64 = ElementType::S64;
  bool floating = is_float(x.element());
  Value isnan = floating ? c.b.compare(x, x, Compare::NE) : c.b.constant_bool(false, x.dims());
  Value k;
  if (op == "kthvalue") {
    k = c.b.constant_int(c.int_arg("k") - 1, i64, row_dims);
  } else if (op == "median" || !floating) {
    k = c.b.constant_int((n - 1) / 2, i64, row_dims);
  } else {  // nanmedian: the lower median of the values that are not NaN
    Value count = reduce<B>(c.b, c.b.convert(c.b.compare(x, x, Compare::EQ), i64), {dim}, Reducer::Add);
    Value minus_one = c.b.binary("subtract", count, c.b.constant_int(1, i64, row_dims));
    k = c.b.binary("divide", c.b.binary("maximum", minus_one, c.b.constant_int(0, i64, row_dims)),
                   c.b.constant_int(2, i64, row_dims));
  }
  auto [value, index] = kth_smallest<B>(c.b, x, dim, k);
  if (op == "median" && floating) {
    // A row with a NaN has NaN for its median, at its first NaN. (kthvalue
    // just sorts NaN last.)
    Value any_nan = reduce<B>(c.b, isnan, {dim}, Reducer::Or);
    Value iota = c.b.iota(TensorType{i64, x.dims()}, dim);
    Value first_nan = reduce<B>(c.b, c.b.select(isnan, iota, c.b.constant_int(n, i64, x.dims())), {dim}, Reducer::Min);
    value = c.b.select(any_nan, c.b.constant(NAN, x.element(), row_dims), value);
    index = c.b.select(any_nan, first_nan, index);
  }
  std::vector<Value> out{c.b.reshape(value, c.output(0).dims)};
  if (c.output_count() > 1) out.push_back(c.b.reshape(index, c.output(1).dims));
  return out;
}
template <bool B>
std::vector<Value> lower_kthvalue(Context& c) { return order_statistic<B>(c, "kthvalue"); }
template <bool B>
std::vector<Value> lower_median(Context& c) { return order_statistic<B>(c, "median"); }
template <bool B>
std::vector<Value> lower_nanmedian(Context& c) { return order_statistic<B>(c, "nanmedian"); }

template <bool B>
void register_reductions(Table& t, const std::string& platform) {
  add_lowerings(t, {{"sum", lower_sum<B>, kComplex}, {"prod", lower_prod<B>, kComplex}, {"amax", lower_amax<B>},
                    {"amin", lower_amin<B>}, {"nansum", lower_nansum<B>}, {"mean", lower_mean<B>, kComplex},
                    {"any", lower_any<B>, kComplex}, {"all", lower_all<B>, kComplex}, {"max", lower_max<B>},
                    {"min", lower_min<B>}, {"argmax", lower_argmax}, {"argmin", lower_argmin}, {"var", lower_var<B>},
                    {"std", lower_std<B>}, {"var_mean", lower_var_mean<B>}, {"std_mean", lower_std_mean<B>},
                    {"logsumexp", lower_logsumexp<B>}, {"cumsum", lower_cumsum, kComplex},
                    {"cumprod", lower_cumprod, kComplex}, {"count_nonzero", lower_count_nonzero<B>, kComplex},
                    {"kthvalue", lower_kthvalue<B>}, {"median", lower_median<B>}, {"nanmedian", lower_nanmedian<B>}},
                platform);
  RuleRef norm = rule(t, "linalg_vector_norm", platform).complex_ok();
  norm.rule().fn = lower_linalg_vector_norm<B>;
  norm.rule().bake_scalars = true;
  // Over a mask growing per token (transformers checks `mask.sum() == mask.numel()`): the padding is the identity.
  for (const char* name : {"sum", "nansum", "any", "count_nonzero"}) rule(t, name, platform).length_padding(0);
  for (const char* name : {"prod", "all"}) rule(t, name, platform).length_padding(1);
  for (const char* name : {"sum", "mean"}) rule(t, name, platform).inputs_overlap_unchecked();  // as the CPU kernels
}

}  // namespace

// The blocked first level of large reductions helps XLA:CPU only (see reduce): a rule of the "cpu"
// platform beside the generic one.
void register_reduction(Table& t) {
  register_reductions<false>(t, "");
  register_reductions<true>(t, "cpu");
  // mode's out= form rejects devices other than CPU/CUDA/XPU in its generic kernel: sent to the CPU instead.
  rule(t, "mode.values").route(Route::ToLowering);
}

}  // namespace torch_pjrt::lowering
