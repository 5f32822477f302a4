// Gradient scaling for mixed precision (torch.amp.GradScaler), with the CPU
// kernels' arithmetic (ATen/native/cpu/AmpGradScalerKernels.cpp).
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// torch_pjrt::_amp_unscale_(self, found_inf, inv_scale): one tensor of
// _amp_foreach_non_finite_check_and_unscale_ (autocast.cpp loops over the
// list). self * inv_scale in the op math type (f32 for f16/bf16), and
// found_inf becomes 1 if any element of self is not finite.
std::vector<Value> lower_amp_unscale(Context& c) {
  ElementType in = c.tensor_element("self");
  if (!is_float(in) || TensorType{in, c.tensor_dims("found_inf")}.element_count() != 1 ||
      TensorType{in, c.tensor_dims("inv_scale")}.element_count() != 1)
    throw Unsupported("_amp_unscale_ arguments the CPU kernel rejects");  // CPU raises its error
  ElementType e = widen(in);
  Value x = c.b.convert(c.tensor("self"), e);
  Value inv = c.b.reshape(c.tensor("inv_scale"), {});
  Value inv_e = c.b.broadcast_in_dim(c.b.convert(inv, e), x.dims(), {});
  // CPU skips the multiply when inv_scale == 1 (so inf * 1 stays inf, NaN stays NaN either way).
  Value one = c.b.compare(inv, c.b.constant(1, inv.element()), hlo::Compare::EQ);
  Value scaled = c.b.select(c.b.broadcast_in_dim(one, x.dims(), {}), x, c.b.binary("multiply", x, inv_e));
  // Not finite: |x| < inf fails for inf and NaN alike.
  Value finite = c.b.compare(c.b.unary("abs", x), full(c.b, INFINITY, x), hlo::Compare::LT);
  Value all_finite = c.b.reduce(finite, c.b.constant_bool(true), all_dims(x.rank()), hlo::Reducer::And);
  Value found = c.tensor("found_inf");
  Value flag = c.b.broadcast_in_dim(c.b.unary("not", all_finite), found.dims(), {});
  return {scaled, c.b.select(flag, full(c.b, 1, found), found)};
}

// _amp_update_scale_(self=scale, growth_tracker, found_inf, growth, backoff, interval):
// back off and reset the tracker after an inf; otherwise count, and grow the
// scale (if it stays finite) every `interval` successful steps.
std::vector<Value> lower_amp_update_scale(Context& c) {
  Builder& b = c.b;
  for (const char* name : {"self", "growth_tracker", "found_inf"})
    if (TensorType{ElementType::F32, c.tensor_dims(name)}.element_count() != 1)
      throw Unsupported("_amp_update_scale_ with a tensor of more than one element");  // CPU raises
  Value scale = c.tensor("self"), tracker = c.tensor("growth_tracker");
  Value found = b.reshape(b.convert(c.tensor("found_inf"), ElementType::F32), {});
  Value s = b.reshape(scale, {}), t = b.reshape(tracker, {});
  Value inf_found = b.compare(found, b.constant(0, ElementType::F32), hlo::Compare::NE);
  // float * double in double, then stored as float, as the CPU computes it.
  auto times = [&](double factor) {
    Value wide = b.binary("multiply", b.convert(s, ElementType::F64), b.constant(factor, ElementType::F64));
    return b.convert(wide, s.element());
  };
  Value backed_off = times(c.float_arg("scale_backoff_factor"));
  Value grown = times(c.float_arg("scale_growth_factor"));
  Value successful = b.binary("add", t, b.constant_int(1, t.element()));
  Value at_interval = b.compare(successful, b.constant_int(c.int_arg("growth_interval"), t.element()), hlo::Compare::EQ);
  Value grown_finite = b.compare(b.unary("abs", grown), b.constant(INFINITY, grown.element()), hlo::Compare::LT);
  Value zero = b.constant_int(0, t.element());
  Value new_s = b.select(inf_found, backed_off, b.select(at_interval, b.select(grown_finite, grown, s), s));
  Value new_t = b.select(inf_found, zero, b.select(at_interval, zero, successful));
  return {b.reshape(new_s, scale.dims()), b.reshape(new_t, tracker.dims())};
}

}  // namespace

void register_amp(Table& t) {
  add_lowering(t, "torch_pjrt::_amp_unscale", lower_amp_unscale);
  add_lowering(t, "_amp_update_scale", lower_amp_update_scale);
}

}  // namespace torch_pjrt::lowering
