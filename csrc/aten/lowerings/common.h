// Small helpers shared by the lowering families (torch-free).
#pragma once
#include <cmath>
#include <limits>
#include <string>

#include "aten/lowering.h"

namespace torch_pjrt::lowering {

// f16/bf16 math runs in f32 and rounds once at the end, as PyTorch's CPU kernels do.
inline ElementType widen(ElementType e) {
  return e == ElementType::F16 || e == ElementType::BF16 ? ElementType::F32 : e;
}

// A tensor or Scalar argument as a value of `element` broadcast to `dims`.
inline Value operand(Context& c, std::string_view name, ElementType element, const Dims& dims) {
  if (c.is_tensor(name)) return to(c.b, c.tensor(name), element, dims);
  return c.b.broadcast_in_dim(c.scalar(name, element), dims, {});
}

inline Value full(Builder& b, double v, const Value& like) { return b.constant(v, like.element(), like.dims()); }

inline double max_finite(ElementType e) {
  switch (e) {
    case ElementType::F16: return 65504.0;
    case ElementType::BF16: return 3.3895313892515355e38;
    case ElementType::F32: return 3.4028234663852886e38;
    default: return 1.7976931348623157e308;
  }
}

inline Dims reduce_dims(Context& c, std::string_view name, int64_t rank) {
  if (!c.has(name) || rank == 0) return all_dims(rank);  // dim 0/-1 of a 0-d tensor is the tensor
  Dims dims = c.int_list(name);
  if (dims.empty()) return all_dims(rank);
  for (auto& d : dims) d = wrap_dim(d, rank);
  return dims;
}

// Smallest and largest values of `e` (infinities for floats), as scalars.
inline Value lowest(Builder& b, ElementType e) {
  if (is_float(e)) return b.constant(-INFINITY, e);
  if (e == ElementType::Pred) return b.constant_bool(false);
  switch (e) {
    case ElementType::S8: return b.constant_int(std::numeric_limits<int8_t>::min(), e);
    case ElementType::S16: return b.constant_int(std::numeric_limits<int16_t>::min(), e);
    case ElementType::S32: return b.constant_int(std::numeric_limits<int32_t>::min(), e);
    case ElementType::S64: return b.constant_int(std::numeric_limits<int64_t>::min(), e);
    default: return b.constant_int(0, e);  // unsigned
  }
}
inline Value highest(Builder& b, ElementType e) {
  if (is_float(e)) return b.constant(INFINITY, e);
  if (e == ElementType::Pred) return b.constant_bool(true);
  switch (e) {
    case ElementType::S8: return b.constant_int(std::numeric_limits<int8_t>::max(), e);
    case ElementType::S16: return b.constant_int(std::numeric_limits<int16_t>::max(), e);
    case ElementType::S32: return b.constant_int(std::numeric_limits<int32_t>::max(), e);
    case ElementType::S64: return b.constant_int(std::numeric_limits<int64_t>::max(), e);
    case ElementType::U8: return b.constant_int(255, e);
    case ElementType::U16: return b.constant_int(65535, e);
    case ElementType::U32: return b.constant_int(4294967295LL, e);
    default: return b.constant_int(-1, e);  // all ones for u64
  }
}

// The value a reduction starts from: x combined with it is x.
inline Value init_for(Builder& b, hlo::Reducer r, ElementType e) {
  using hlo::Reducer;
  switch (r) {
    case Reducer::Add: return e == ElementType::Pred ? b.constant_bool(false) : b.constant(0, e);
    case Reducer::Mul: return e == ElementType::Pred ? b.constant_bool(true) : b.constant(1, e);
    case Reducer::Max: return lowest(b, e);
    case Reducer::Min: return highest(b, e);
    case Reducer::And: return b.constant_bool(true);
    case Reducer::Or: return b.constant_bool(false);
  }
  return b.constant(0, e);
}

// Runtime check (see RuntimeCheck) that every element of `index` lies in
// [0, size), or in [-size, size) with `allow_negative`. The bad value shown is
// the first offending element in row-major order, as the CPU reports.
// With `runtime_size` (Context::runtime_size) the bound is that s64[] instead
// of `size`, and "{size}" in the message shows it.
inline void check_in_range(Context& c, Value index, int64_t size, bool allow_negative, CheckError error,
                           std::string message, std::optional<Value> runtime_size = std::nullopt) {
  Builder& b = c.b;
  int64_t n = index.type.element_count();
  if (n == 0) return;
  // The barrier keeps XLA from folding the check of a constant index (a
  // `torch.zeros` index): XLA:CPU folded it to a failure.
  Value flat = b.unary("optimization_barrier", b.reshape(b.convert(index, ElementType::S64), {n}));
  Value upper = runtime_size ? b.broadcast_in_dim(*runtime_size, {n}, {}) : b.constant_int(size, ElementType::S64, {n});
  Value lower = allow_negative ? b.unary("negate", upper) : b.constant_int(0, ElementType::S64, {n});
  Value below = b.compare(flat, lower, hlo::Compare::LT);
  Value above = b.compare(flat, upper, hlo::Compare::GE);
  Value positions = b.iota(TensorType{ElementType::S64, {n}}, 0);
  Value none = b.constant_int(n, ElementType::S64);
  Value marked = b.select(b.binary("or", below, above), positions, b.broadcast_in_dim(none, {n}, {}));
  Value first = b.reduce(marked, none, {0}, hlo::Reducer::Min);
  Value at = b.binary("minimum", first, b.constant_int(n - 1, ElementType::S64));
  Value bad = b.reshape(b.dynamic_slice(flat, {at}, {1}), {});
  c.check(RuntimeCheck{b.compare(first, none, hlo::Compare::EQ), bad, error, std::move(message), runtime_size});
}

// Integer division by zero: the CPU raises RuntimeError("ZeroDivisionError").
inline void check_nonzero_divisor(Context& c, const Value& divisor) {
  Builder& b = c.b;
  if (is_float(divisor.element()) || divisor.element() == ElementType::Pred || divisor.type.element_count() == 0) return;
  Value kept = b.unary("optimization_barrier", divisor);  // as in check_in_range: no folding of constant divisors
  Value nonzero = b.compare(kept, b.constant_int(0, divisor.element(), divisor.dims()), hlo::Compare::NE);
  Value ok = b.reduce(nonzero, b.constant_bool(true), all_dims(divisor.rank()), hlo::Reducer::And);
  c.check(RuntimeCheck{ok, b.constant_int(0, ElementType::S64), CheckError::Runtime, "ZeroDivisionError"});
}

}  // namespace torch_pjrt::lowering
