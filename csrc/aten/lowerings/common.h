// Small helpers shared by the lowering families (torch-free).
#pragma once
#include <cmath>

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

}  // namespace torch_pjrt::lowering
