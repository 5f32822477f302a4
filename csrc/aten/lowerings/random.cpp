// Random numbers from a counter-based generator: each op takes a fresh
// (seed, offset) Threefry state from the tpu generator (see Context::rng_state),
// so draws are reproducible under manual_seed and never repeat. Uniform floats
// fill the mantissa from random bits; normals use Box-Muller.
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// Uniform [0, 1) values of `element` (f32 or f64) with `dims`.
Value uniform01(Context& c, ElementType element, const Dims& dims, int64_t count) {
  Builder& b = c.b;
  bool f64 = element == ElementType::F64;
  ElementType bits_type = f64 ? ElementType::U64 : ElementType::U32;
  Value bits = b.rng_bit_generator(c.rng_state(count), TensorType{bits_type, dims})[1];
  Value mantissa = b.binary("shift_right_logical", bits, b.constant_int(f64 ? 12 : 9, bits_type, dims));
  Value one_bits = b.constant_int(f64 ? 0x3FF0000000000000LL : 0x3F800000LL, bits_type, dims);
  Value in_one_two = b.bitcast_convert(b.binary("or", mantissa, one_bits), TensorType{element, dims});
  return b.binary("subtract", in_one_two, b.constant(1, element, dims));
}

ElementType float_compute(ElementType e) { return e == ElementType::F64 ? ElementType::F64 : ElementType::F32; }

std::vector<Value> lower_uniform(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = float_compute(o.element);
  Value u = uniform01(c, e, o.dims, TensorType{e, o.dims}.element_count());
  Value from = operand(c, "from", e, o.dims), to = operand(c, "to", e, o.dims);
  return {c.b.binary("add", from, c.b.binary("multiply", u, c.b.binary("subtract", to, from)))};
}

// Box-Muller on two uniform draws: sqrt(-2 ln(1 - u1)) * cos(2 pi u2).
Value standard_normal(Context& c, ElementType e, const Dims& dims) {
  int64_t n = TensorType{e, dims}.element_count();
  Dims twice{2, n};
  Value u = uniform01(c, e, twice, 2 * n);
  Dims start{0, 0}, mid{1, n}, end{2, n}, step{1, 1};
  Value u1 = c.b.reshape(c.b.slice(u, start, mid, step), dims);
  Value u2 = c.b.reshape(c.b.slice(u, {1, 0}, end, step), dims);
  Value radius = c.b.unary("sqrt", c.b.binary("multiply", full(c.b, -2, u1),
                                             c.b.unary("log", c.b.binary("subtract", full(c.b, 1, u1), u1))));
  Value angle = c.b.binary("multiply", full(c.b, 2 * M_PI, u2), u2);
  return c.b.binary("multiply", radius, c.b.unary("cosine", angle));
}

std::vector<Value> lower_normal(Context& c) {
  const OutputMeta& o = c.output(0);
  if (is_complex(o.element)) {
    // As the CPU: both parts of view_as_real(self) ~ N(mean, std / sqrt(2)).
    if (c.is_tensor("mean") || c.is_tensor("std")) throw Unsupported("complex normal with tensor mean or std");
    ElementType e = real_part_type(o.element);
    Dims both = o.dims;
    both.push_back(2);
    Value z = standard_normal(c, e, both);
    Value std = c.b.binary("multiply", operand(c, "std", e, both), full(c.b, M_SQRT1_2, z));
    Value parts = c.b.binary("add", operand(c, "mean", e, both), c.b.binary("multiply", z, std));
    Dims start(both.size(), 0), limit = both, step(both.size(), 1);
    limit.back() = 1;
    Value re = c.b.reshape(c.b.slice(parts, start, limit, step), o.dims);
    start.back() = 1;
    limit.back() = 2;
    Value im = c.b.reshape(c.b.slice(parts, start, limit, step), o.dims);
    return {c.b.complex(re, im)};
  }
  ElementType e = float_compute(o.element);
  Value z = standard_normal(c, e, o.dims);
  return {c.b.binary("add", operand(c, "mean", e, o.dims), c.b.binary("multiply", z, operand(c, "std", e, o.dims)))};
}

// random_(from, to): integers in [from, to); bounds are baked (they set the range).
std::vector<Value> lower_random(Context& c) {
  const OutputMeta& o = c.output(0);
  double from = c.has("from") ? c.scalar_value("from") : 0;
  double to;
  if (c.has("to")) {
    to = c.scalar_value("to");
  } else {
    // Without `to`: [0, 2^mantissa] for floats, the dtype's range otherwise.
    switch (o.element) {
      case ElementType::F16: to = 2049; break;
      case ElementType::BF16: to = 257; break;
      case ElementType::F32: to = 16777217; break;
      case ElementType::F64: to = 9007199254740993.0; break;
      case ElementType::Pred: to = 2; break;
      case ElementType::U8: to = 256; break;
      case ElementType::S8: to = 128; break;
      case ElementType::S16: to = 32768; break;
      case ElementType::S32: to = 2147483648.0; break;
      default: to = 9223372036854775807.0; break;
    }
  }
  if (!(to > from)) throw Unsupported("random_ with an empty range");
  Value bits = c.b.rng_bit_generator(c.rng_state(TensorType{o.element, o.dims}.element_count()),
                                     TensorType{ElementType::U64, o.dims})[1];
  Value range = c.b.constant_int(static_cast<int64_t>(to - from), ElementType::U64, o.dims);
  Value offset = c.b.convert(c.b.binary("remainder", bits, range), ElementType::S64);
  Value v = c.b.binary("add", offset, c.b.constant_int(static_cast<int64_t>(from), ElementType::S64, o.dims));
  return {c.b.convert(v, o.element)};
}

// bernoulli_(p: float or tensor), bernoulli(self: probabilities)
std::vector<Value> lower_bernoulli(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = float_compute(o.element);
  Value u = uniform01(c, e, o.dims, TensorType{e, o.dims}.element_count());
  Value p = c.has("p") ? (c.is_tensor("p") ? to(c.b, c.tensor("p"), e, o.dims)
                                           : c.b.constant(c.float_arg("p"), e, o.dims))
                       : to(c.b, c.tensor("self"), e, o.dims);
  return {c.b.compare(u, p, hlo::Compare::LT)};
}

std::vector<Value> lower_exponential(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = float_compute(o.element);
  Value u = uniform01(c, e, o.dims, TensorType{e, o.dims}.element_count());
  Value minus_log = c.b.unary("negate", c.b.unary("log_plus_one", c.b.unary("negate", u)));
  return {c.b.binary("divide", minus_log, c.b.constant(c.float_arg("lambd"), e, o.dims))};
}

// native_dropout(input, p, train) -> (output, mask); p is baked (float arg).
std::vector<Value> lower_native_dropout(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value x = c.b.convert(c.tensor("input"), e);
  double p = c.float_arg("p");
  if (c.has("train") && !c.bool_arg("train")) return {x, c.b.constant_bool(true, o.dims)};
  Value keep = c.b.compare(uniform01(c, float_compute(e), o.dims, x.type.element_count()),
                           c.b.constant(p, float_compute(e), o.dims), hlo::Compare::GE);
  double scale = p >= 1 ? 0 : 1 / (1 - p);
  Value y = c.b.select(keep, c.b.binary("multiply", x, full(c.b, scale, x)), zeros_like(c.b, x));
  return {y, keep};
}

std::vector<Value> lower_native_dropout_backward(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value g = c.b.convert(c.tensor("grad_output"), e);
  Value mask = to(c.b, c.tensor("mask"), e, g.dims());
  return {c.b.binary("multiply", c.b.binary("multiply", g, mask), c.b.broadcast_in_dim(c.scalar("scale", e), g.dims(), {}))};
}

}  // namespace

void register_random(Table& t) {
  add_lowerings(t, {
           {"uniform", lower_uniform}, {"normal", lower_normal, kComplex}, {"bernoulli", lower_bernoulli},
           {"exponential", lower_exponential}, {"native_dropout", lower_native_dropout},
           {"native_dropout_backward", lower_native_dropout_backward}});
  add_lowering(t, "random", lower_random, /*bake_scalars=*/true);
}

}  // namespace torch_pjrt::lowering
