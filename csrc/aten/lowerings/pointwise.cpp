// Elementwise ops: unary math, binary arithmetic, comparisons, logical ops,
// where/clamp/lerp, fills and copies, and the activations with their backward.
// Each lowering computes in the output's dtype (widened for f16/bf16) over the
// broadcast output shape; the executor casts the result back.
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// The output's shape and the dtype math runs in.
struct Out {
  Dims dims;
  ElementType element;
  ElementType compute;
  explicit Out(Context& c) : dims(c.output(0).dims), element(c.output(0).element), compute(widen(element)) {}
};

Value in(Context& c, const Out& o, std::string_view name = "self") { return operand(c, name, o.compute, o.dims); }

template <const char* Op>
std::vector<Value> unary(Context& c) {
  Out o(c);
  return {c.b.unary(Op, in(c, o))};
}

#define UNARY(name, op)          \
  constexpr char k_##name[] = op; \
  constexpr auto lower_##name = unary<k_##name>;
UNARY(neg, "negate")
UNARY(exp, "exponential")
UNARY(expm1, "exponential_minus_one")
UNARY(log, "log")
UNARY(log1p, "log_plus_one")
UNARY(sqrt, "sqrt")
UNARY(rsqrt, "rsqrt")
UNARY(sin, "sine")
UNARY(cos, "cosine")
UNARY(tan, "tan")
UNARY(tanh, "tanh")
UNARY(sigmoid, "logistic")
UNARY(asin, "chlo.asin")
UNARY(acos, "chlo.acos")
UNARY(atan, "chlo.atan")
UNARY(sinh, "chlo.sinh")
UNARY(cosh, "chlo.cosh")
UNARY(asinh, "chlo.asinh")
UNARY(acosh, "chlo.acosh")
UNARY(atanh, "chlo.atanh")
UNARY(erf, "chlo.erf")
UNARY(erfc, "chlo.erfc")
UNARY(erfinv, "chlo.erf_inv")
UNARY(lgamma, "chlo.lgamma")
#undef UNARY

// sign(NaN) is 0 on the CPU; unsigned and bool values are 0 or positive.
std::vector<Value> lower_sign(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (is_complex(o.compute)) {  // sgn: x / |x|, and 0 at 0
    Value magnitude = c.b.convert(c.b.unary("abs", x), o.compute);
    Value zero = full(c.b, 0, x);
    return {c.b.select(c.b.compare(magnitude, zero, hlo::Compare::EQ), zero, c.b.binary("divide", x, magnitude))};
  }
  if (is_unsigned(o.compute) || o.compute == ElementType::Pred)
    return {c.b.convert(c.b.compare(x, full(c.b, 0, x), hlo::Compare::NE), o.compute)};
  Value s = c.b.unary("sign", x);
  if (!is_float(o.compute)) return {s};
  // NaN gives 0, and so does -0: XLA keeps its sign, the CPU's (0 < x) - (x < 0) is +0.
  Value zero = full(c.b, 0, x);
  Value none = c.b.binary("or", c.b.compare(x, x, hlo::Compare::NE), c.b.compare(x, zero, hlo::Compare::EQ));
  return {c.b.select(none, zero, s)};
}
// Unsigned values are their own absolute value; the CPU has no abs of bool.
std::vector<Value> lower_abs(Context& c) {
  Out o(c);
  if (o.compute == ElementType::Pred) throw Unsupported("abs of bool");
  if (is_complex(c.tensor_element("self"))) return {c.b.unary("abs", c.tensor("self"))};  // a real magnitude
  Value x = in(c, o);
  return {is_unsigned(o.compute) ? x : c.b.unary("abs", x)};
}
// Rounding an integer leaves it as it is (stablehlo's ops take floats only).
template <const char* Op>
std::vector<Value> rounding(Context& c) {
  Out o(c);
  if (o.compute == ElementType::Pred) throw Unsupported("rounding bool");  // the CPU raises
  Value x = in(c, o);
  return {is_float(o.compute) ? c.b.unary(Op, x) : x};
}
constexpr char k_ceil[] = "ceil", k_floor[] = "floor";
constexpr auto lower_ceil = rounding<k_ceil>;
constexpr auto lower_floor = rounding<k_floor>;
// digamma(+-0) is -+inf on the CPU (the pole's one-sided limit); chlo gives NaN.
Value digamma(Builder& b, Value x) {
  Value pole = b.unary("negate", b.binary("divide", full(b, 1, x), x));  // -1/x: -inf at +0, +inf at -0
  return b.select(b.compare(x, full(b, 0, x), hlo::Compare::EQ), pole, b.unary("chlo.digamma", x));
}
std::vector<Value> lower_digamma(Context& c) {
  Out o(c);
  return {digamma(c.b, in(c, o))};
}

// polygamma(0, x) is digamma. (chlo.polygamma for n >= 1 loses all accuracy
// at negative x in f32, so those run on the CPU.)
std::vector<Value> lower_polygamma(Context& c) {
  Out o(c);
  if (!is_float(o.compute) || c.int_arg("n") != 0) throw Unsupported("polygamma with n >= 1");
  return {digamma(c.b, in(c, o))};
}
// special_zeta(x, q): the Hurwitz zeta function.
std::vector<Value> lower_zeta(Context& c) {
  Out o(c);
  if (!is_float(o.compute)) throw Unsupported("zeta of integers");
  return {c.b.binary("chlo.zeta", in(c, o), in(c, o, "other"))};
}

// x * k for a real k. A complex x scales part by part, as the CPU's
// complex-by-real arithmetic does: (-inf + 0j) * k has imaginary part 0, not
// the NaN of a complex product with k + 0j.
Value times_real(Builder& b, Value x, double k) {
  if (!is_complex(x.element())) return b.binary("multiply", x, full(b, k, x));
  Value re = b.real(x), im = b.imag(x);
  return b.complex(b.binary("multiply", re, full(b, k, re)), b.binary("multiply", im, full(b, k, im)));
}
std::vector<Value> lower_log2(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (is_complex(x.element())) return {times_real(c.b, c.b.unary("log", x), 1.0 / std::log(2.0))};
  return {c.b.binary("divide", c.b.unary("log", x), full(c.b, std::log(2.0), x))};
}
std::vector<Value> lower_log10(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (is_complex(x.element())) return {times_real(c.b, c.b.unary("log", x), 1.0 / std::log(10.0))};
  return {c.b.binary("divide", c.b.unary("log", x), full(c.b, std::log(10.0), x))};
}
std::vector<Value> lower_exp2(Context& c) {
  Out o(c);
  Value x = in(c, o);
  return {c.b.unary("exponential", times_real(c.b, x, std::log(2.0)))};
}
// round(x, decimals): scaled by 10^|decimals| as PyTorch does, ties to even.
std::vector<Value> lower_round(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (!is_float(o.compute)) {
    if (c.has("decimals") || o.compute == ElementType::Pred) throw Unsupported("round of bool, or of integers with decimals=");  // the CPU raises
    return {x};
  }
  int64_t decimals = c.has("decimals") ? c.int_arg("decimals") : 0;
  if (decimals == 0) return {c.b.unary("round_nearest_even", x)};
  Value scale = full(c.b, std::pow(10.0, static_cast<double>(std::abs(decimals))), x);
  const char* into = decimals > 0 ? "multiply" : "divide";
  const char* back = decimals > 0 ? "divide" : "multiply";
  return {c.b.binary(back, c.b.unary("round_nearest_even", c.b.binary(into, x, scale)), scale)};
}
std::vector<Value> lower_reciprocal(Context& c) {
  Out o(c);
  Value x = in(c, o);
  return {c.b.binary("divide", full(c.b, 1, x), x)};
}
std::vector<Value> lower_trunc(Context& c) {
  Out o(c);
  if (o.compute == ElementType::Pred) throw Unsupported("trunc of bool");  // the CPU raises
  Value x = in(c, o);
  if (!is_float(o.compute)) return {x};
  return {c.b.select(c.b.compare(x, full(c.b, 0, x), hlo::Compare::LT), c.b.unary("ceil", x), c.b.unary("floor", x))};
}
std::vector<Value> lower_frac(Context& c) {
  Out o(c);
  Value x = in(c, o);
  Value t = c.b.select(c.b.compare(x, full(c.b, 0, x), hlo::Compare::LT), c.b.unary("ceil", x), c.b.unary("floor", x));
  return {c.b.binary("subtract", x, t)};
}
std::vector<Value> lower_relu(Context& c) {
  Out o(c);
  Value x = in(c, o);
  return {c.b.binary("maximum", x, full(c.b, 0, x))};
}
// Bitwise ops run in the inputs' integer type (an out= tensor may be
// floating: the CPU casts the integer result into it).
std::vector<Value> lower_bitwise_not(Context& c) {
  ElementType t = c.tensor_element("self");
  return {c.b.unary("not", operand(c, "self", t, c.output(0).dims))};
}
std::vector<Value> lower_logical_not(Context& c) {
  Out o(c);
  Value x = to(c.b, c.tensor("self"), ElementType::Pred, o.dims);
  return {c.b.unary("not", x)};
}
std::vector<Value> lower_isnan(Context& c) {
  Value x = c.tensor("self");
  if (!is_float(x.element()) && !is_complex(x.element())) return {c.b.constant_bool(false, x.dims())};
  return {c.b.compare(x, x, hlo::Compare::NE)};  // complex: either part NaN
}
std::vector<Value> lower_isinf(Context& c) {
  Value x = c.tensor("self");
  if (is_complex(x.element())) {  // either part infinite (|x| would overflow for large finite parts)
    Value re = c.b.unary("abs", c.b.real(x)), im = c.b.unary("abs", c.b.imag(x));
    return {c.b.binary("or", c.b.compare(re, full(c.b, INFINITY, re), hlo::Compare::EQ),
                       c.b.compare(im, full(c.b, INFINITY, im), hlo::Compare::EQ))};
  }
  if (!is_float(x.element())) return {c.b.constant_bool(false, x.dims())};
  return {c.b.compare(c.b.unary("abs", x), full(c.b, INFINITY, x), hlo::Compare::EQ)};
}
// True for a set sign bit: -0.0 and negative NaNs included, as std::signbit.
std::vector<Value> lower_signbit(Context& c) {
  Value x = c.tensor("self");
  ElementType e = x.element();
  if (e == ElementType::Pred || !(is_float(e) || is_signed_int(e))) return {c.b.constant_bool(false, x.dims())};
  if (is_float(e)) {
    ElementType bits = byte_size(e) == 8 ? ElementType::S64 : byte_size(e) == 4 ? ElementType::S32 : ElementType::S16;
    x = c.b.bitcast_convert(x, {bits, x.dims()});
  }
  return {c.b.compare(x, c.b.constant_int(0, x.element(), x.dims()), hlo::Compare::LT)};
}
std::vector<Value> lower_nan_to_num(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (!is_float(o.compute)) return {x};
  double nan = c.has("nan") ? c.float_arg("nan") : 0.0;
  double pos = c.has("posinf") ? c.float_arg("posinf") : max_finite(o.element);
  double negv = c.has("neginf") ? c.float_arg("neginf") : -max_finite(o.element);
  Value r = c.b.select(c.b.compare(x, x, hlo::Compare::NE), full(c.b, nan, x), x);
  r = c.b.select(c.b.compare(r, full(c.b, INFINITY, x), hlo::Compare::EQ), full(c.b, pos, x), r);
  return {c.b.select(c.b.compare(r, full(c.b, -INFINITY, x), hlo::Compare::EQ), full(c.b, negv, x), r)};
}

// ---- binary arithmetic ----

std::vector<Value> add_or_sub(Context& c, const char* op) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  if (o.compute == ElementType::Pred) return {c.b.binary(std::string(op) == "add" ? "or" : "xor", a, b)};
  if (c.has("alpha")) b = c.b.binary("multiply", b, operand(c, "alpha", o.compute, o.dims));
  return {c.b.binary(op, a, b)};
}
std::vector<Value> lower_add(Context& c) { return add_or_sub(c, "add"); }
std::vector<Value> lower_sub(Context& c) { return add_or_sub(c, "subtract"); }
std::vector<Value> lower_rsub(Context& c) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  if (c.has("alpha")) a = c.b.binary("multiply", a, operand(c, "alpha", o.compute, o.dims));
  return {c.b.binary("subtract", b, a)};
}
std::vector<Value> lower_mul(Context& c) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  return {c.b.binary(o.compute == ElementType::Pred ? "and" : "multiply", a, b)};
}

Value floor_divide_int(Builder& b, Value x, Value y) {
  Value q = b.binary("divide", x, y);
  Value r = b.binary("remainder", x, y);
  Value zero = full(b, 0, x);
  Value inexact = b.compare(r, zero, hlo::Compare::NE);
  Value signs_differ = b.compare(b.compare(x, zero, hlo::Compare::LT), b.compare(y, zero, hlo::Compare::LT),
                                 hlo::Compare::NE);
  Value adjust = b.binary("and", inexact, signs_differ);
  return b.select(adjust, b.binary("subtract", q, full(b, 1, q)), q);
}

std::vector<Value> lower_div(Context& c) {
  Out o(c);
  std::string mode = c.has("rounding_mode") ? c.string_arg("rounding_mode") : "";
  Value a = in(c, o), b = in(c, o, "other");
  if (mode.empty()) return {c.b.binary("divide", a, b)};
  check_nonzero_divisor(c, b);
  if (!is_float(o.compute)) return {mode == "trunc" ? c.b.binary("divide", a, b) : floor_divide_int(c.b, a, b)};
  Value q = c.b.binary("divide", a, b);
  if (mode == "floor") return {c.b.unary("floor", q)};
  return {c.b.select(c.b.compare(q, full(c.b, 0, q), hlo::Compare::LT), c.b.unary("ceil", q), c.b.unary("floor", q))};
}
std::vector<Value> lower_floor_divide(Context& c) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  check_nonzero_divisor(c, b);
  if (!is_float(o.compute)) return {floor_divide_int(c.b, a, b)};
  return {c.b.unary("floor", c.b.binary("divide", a, b))};
}
std::vector<Value> lower_remainder(Context& c) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  check_nonzero_divisor(c, b);
  Value r = c.b.binary("remainder", a, b);
  Value zero = full(c.b, 0, r);
  Value fix = c.b.binary("and", c.b.compare(r, zero, hlo::Compare::NE),
                         c.b.compare(c.b.compare(r, zero, hlo::Compare::LT), c.b.compare(b, zero, hlo::Compare::LT),
                                     hlo::Compare::NE));
  return {c.b.select(fix, c.b.binary("add", r, b), r)};
}
std::vector<Value> lower_fmod(Context& c) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  check_nonzero_divisor(c, b);
  return {c.b.binary("remainder", a, b)};
}
template <const char* Op>
std::vector<Value> binary(Context& c) {
  Out o(c);
  return {c.b.binary(Op, in(c, o), in(c, o, "other"))};
}
template <const char* Op>
std::vector<Value> bitwise(Context& c) {
  ElementType t = c.promoted({"self", "other"});
  const Dims& dims = c.output(0).dims;
  return {c.b.binary(Op, operand(c, "self", t, dims), operand(c, "other", t, dims))};
}
// Shifts as the CPU's kernels: a shift by a negative amount or by the width
// or more gives 0 (left) or the sign fill (right). Either side may be a Scalar.
std::vector<Value> shift(Context& c, bool left) {
  ElementType t = c.promoted({"self", "other"});
  if (!is_signed_int(t) && !is_unsigned(t)) throw Unsupported("shift of non-integers");  // the CPU raises
  const Dims& dims = c.output(0).dims;
  Value a = operand(c, "self", t, dims), n = operand(c, "other", t, dims);
  int64_t bits = static_cast<int64_t>(byte_size(t)) * 8;
  Value zero = c.b.constant_int(0, t, dims);
  Value out_of_range = c.b.compare(n, c.b.constant_int(bits, t, dims), hlo::Compare::GE);
  if (is_signed_int(t)) out_of_range = c.b.binary("or", out_of_range, c.b.compare(n, zero, hlo::Compare::LT));
  Value safe_n = c.b.select(out_of_range, zero, n);
  if (left) return {c.b.select(out_of_range, zero, c.b.binary("shift_left", a, safe_n))};
  const char* right = is_unsigned(t) ? "shift_right_logical" : "shift_right_arithmetic";
  Value fill = is_unsigned(t) ? zero : c.b.binary(right, a, c.b.constant_int(bits - 1, t, dims));
  return {c.b.select(out_of_range, fill, c.b.binary(right, a, safe_n))};
}
std::vector<Value> lower_bitwise_left_shift(Context& c) { return shift(c, true); }
std::vector<Value> lower_bitwise_right_shift(Context& c) { return shift(c, false); }

constexpr char k_maximum[] = "maximum", k_minimum[] = "minimum", k_atan2[] = "atan2",
               k_and[] = "and", k_or[] = "or", k_xor[] = "xor";

// sqrt(a^2 + b^2) scaled by the larger magnitude, so it neither overflows nor
// underflows where the result is representable (as std::hypot).
std::vector<Value> lower_hypot(Context& c) {
  Out o(c);
  Value a = c.b.unary("abs", in(c, o)), b = c.b.unary("abs", in(c, o, "other"));
  Value big = c.b.binary("maximum", a, b), small = c.b.binary("minimum", a, b);
  Value ratio = c.b.binary("divide", small, big);
  Value r = c.b.binary("multiply", big, c.b.unary("sqrt", c.b.binary("add", full(c.b, 1, a), c.b.binary("multiply", ratio, ratio))));
  r = c.b.select(c.b.compare(big, full(c.b, 0, a), hlo::Compare::EQ), full(c.b, 0, a), r);
  return {c.b.select(c.b.compare(big, full(c.b, INFINITY, a), hlo::Compare::EQ), big, r)};
}

std::vector<Value> lower_pow(Context& c) {
  Out o(c);
  return {c.b.binary("power", in(c, o), in(c, o, "exponent"))};
}

// fmax/fmin ignore NaN unless both are NaN.
std::vector<Value> fmax_fmin(Context& c, const char* op) {
  Out o(c);
  Value a = in(c, o), b = in(c, o, "other");
  Value r = c.b.binary(op, a, b);
  if (!is_float(o.compute)) return {r};
  r = c.b.select(c.b.compare(a, a, hlo::Compare::NE), b, r);
  return {c.b.select(c.b.compare(b, b, hlo::Compare::NE), a, r)};
}
std::vector<Value> lower_fmax(Context& c) { return fmax_fmin(c, "maximum"); }
std::vector<Value> lower_fmin(Context& c) { return fmax_fmin(c, "minimum"); }

std::vector<Value> logical(Context& c, const char* op) {
  Out o(c);
  Value a = operand(c, "self", ElementType::Pred, o.dims), b = operand(c, "other", ElementType::Pred, o.dims);
  return {c.b.binary(op, a, b)};
}
std::vector<Value> lower_logical_and(Context& c) { return logical(c, "and"); }
std::vector<Value> lower_logical_or(Context& c) { return logical(c, "or"); }
std::vector<Value> lower_logical_xor(Context& c) { return logical(c, "xor"); }

template <hlo::Compare Dir>
std::vector<Value> compare(Context& c) {
  Dims dims = c.output(0).dims;
  ElementType t = c.promoted({"self", "other"});
  return {c.b.compare(operand(c, "self", t, dims), operand(c, "other", t, dims), Dir)};
}

// ---- ternary and selection ----

std::vector<Value> lower_where(Context& c) {
  Out o(c);
  Value cond = to(c.b, c.tensor("condition"), ElementType::Pred, o.dims);
  return {c.b.select(cond, in(c, o), in(c, o, "other"))};
}
std::vector<Value> lower_clamp(Context& c) {
  Out o(c);
  Value x = in(c, o);
  if (c.has("min")) x = c.b.binary("maximum", x, operand(c, "min", o.compute, o.dims));
  if (c.has("max")) x = c.b.binary("minimum", x, operand(c, "max", o.compute, o.dims));
  return {x};
}
std::vector<Value> lower_clamp_min(Context& c) {
  Out o(c);
  return {c.b.binary("maximum", in(c, o), operand(c, "min", o.compute, o.dims))};
}
std::vector<Value> lower_clamp_max(Context& c) {
  Out o(c);
  return {c.b.binary("minimum", in(c, o), operand(c, "max", o.compute, o.dims))};
}
std::vector<Value> lower_lerp(Context& c) {
  Out o(c);
  Value a = in(c, o), e = in(c, o, "end"), w = operand(c, "weight", o.compute, o.dims);
  Value diff = c.b.binary("subtract", e, a);
  // PyTorch's two-sided form keeps lerp exact at both ends.
  Value low = c.b.binary("add", a, c.b.binary("multiply", w, diff));
  Value high = c.b.binary("subtract", e, c.b.binary("multiply", diff, c.b.binary("subtract", full(c.b, 1, w), w)));
  return {c.b.select(c.b.compare(c.b.unary("abs", w), full(c.b, 0.5, w), hlo::Compare::LT), low, high)};
}
std::vector<Value> addc(Context& c, const char* op) {
  Out o(c);
  Value prod = c.b.binary(op, in(c, o, "tensor1"), in(c, o, "tensor2"));
  if (c.has("value")) prod = c.b.binary("multiply", prod, operand(c, "value", o.compute, o.dims));
  return {c.b.binary("add", in(c, o), prod)};
}
std::vector<Value> lower_addcmul(Context& c) { return addc(c, "multiply"); }
std::vector<Value> lower_addcdiv(Context& c) { return addc(c, "divide"); }
std::vector<Value> lower_masked_fill(Context& c) {
  Out o(c);
  Value mask = to(c.b, c.tensor("mask"), ElementType::Pred, o.dims);
  return {c.b.select(mask, operand(c, "value", o.compute, o.dims), in(c, o))};
}

// ---- fills and copies ----

std::vector<Value> lower_fill(Context& c) {
  Out o(c);
  return {operand(c, "value", o.element, o.dims)};
}
std::vector<Value> lower_zero(Context& c) {
  Out o(c);
  return {c.b.constant(0, o.element, o.dims)};
}
std::vector<Value> lower_copy(Context& c) {
  Out o(c);
  return {to(c.b, c.tensor("src"), o.element, o.dims)};
}
std::vector<Value> lower_clone(Context& c) { return {c.tensor("self")}; }
std::vector<Value> lower_to_copy(Context& c) {
  Out o(c);
  return {c.b.convert(c.tensor("self"), o.element)};
}

// ---- activations and their gradients ----

Value erf_cdf(Builder& b, Value x) {  // 0.5 * (1 + erf(x / sqrt(2)))
  Value e = b.unary("chlo.erf", b.binary("multiply", x, full(b, M_SQRT1_2, x)));
  return b.binary("multiply", full(b, 0.5, x), b.binary("add", full(b, 1, x), e));
}
Value tanh_inner(Builder& b, Value x) {  // sqrt(2/pi) * (x + 0.044715 x^3)
  Value x3 = b.binary("multiply", b.binary("multiply", x, x), x);
  Value inner = b.binary("add", x, b.binary("multiply", full(b, 0.044715, x), x3));
  return b.binary("multiply", full(b, std::sqrt(2.0 / M_PI), x), inner);
}

std::vector<Value> lower_gelu(Context& c) {
  Out o(c);
  Value x = in(c, o);
  bool tanh = c.has("approximate") && c.string_arg("approximate") == "tanh";
  if (!tanh) {
    // At -inf the CPU computes -inf * 0 = NaN; at +inf its vectorized float
    // kernels (all but f64) give NaN too. Match them rather than the limits.
    Value r = c.b.binary("multiply", x, erf_cdf(c.b, x));
    r = c.b.select(c.b.compare(x, full(c.b, -INFINITY, x), hlo::Compare::EQ), full(c.b, NAN, x), r);
    if (o.element == ElementType::F64) return {r};
    return {c.b.select(c.b.compare(x, full(c.b, INFINITY, x), hlo::Compare::EQ), full(c.b, NAN, x), r)};
  }
  Value t = c.b.unary("tanh", tanh_inner(c.b, x));
  return {c.b.binary("multiply", c.b.binary("multiply", full(c.b, 0.5, x), x), c.b.binary("add", full(c.b, 1, x), t))};
}
std::vector<Value> lower_gelu_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  bool tanh = c.has("approximate") && c.string_arg("approximate") == "tanh";
  if (!tanh) {
    Value pdf = c.b.binary("multiply", full(c.b, 1.0 / std::sqrt(2.0 * M_PI), x),
                           c.b.unary("exponential", c.b.binary("multiply", full(c.b, -0.5, x), c.b.binary("multiply", x, x))));
    return {c.b.binary("multiply", g, c.b.binary("add", erf_cdf(c.b, x), c.b.binary("multiply", x, pdf)))};
  }
  Value t = c.b.unary("tanh", tanh_inner(c.b, x));
  Value one = full(c.b, 1, x);
  Value dinner = c.b.binary("multiply", full(c.b, std::sqrt(2.0 / M_PI), x),
                            c.b.binary("add", one, c.b.binary("multiply", full(c.b, 3 * 0.044715, x), c.b.binary("multiply", x, x))));
  Value left = c.b.binary("multiply", full(c.b, 0.5, x), c.b.binary("add", one, t));
  Value right = c.b.binary("multiply", c.b.binary("multiply", full(c.b, 0.5, x), x),
                           c.b.binary("multiply", c.b.binary("subtract", one, c.b.binary("multiply", t, t)), dinner));
  return {c.b.binary("multiply", g, c.b.binary("add", left, right))};
}
std::vector<Value> lower_silu(Context& c) {
  Out o(c);
  Value x = in(c, o);
  return {c.b.binary("multiply", x, c.b.unary("logistic", x))};
}
std::vector<Value> lower_silu_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value s = c.b.unary("logistic", x);
  Value one = full(c.b, 1, x);
  Value d = c.b.binary("multiply", s, c.b.binary("add", one, c.b.binary("multiply", x, c.b.binary("subtract", one, s))));
  return {c.b.binary("multiply", g, d)};
}
std::vector<Value> lower_sigmoid_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), y = in(c, o, "output");
  return {c.b.binary("multiply", g, c.b.binary("multiply", y, c.b.binary("subtract", full(c.b, 1, y), y)))};
}
std::vector<Value> lower_tanh_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), y = in(c, o, "output");
  return {c.b.binary("multiply", g, c.b.binary("subtract", full(c.b, 1, y), c.b.binary("multiply", y, y)))};
}
std::vector<Value> lower_threshold(Context& c) {
  Out o(c);
  Value x = in(c, o);
  // As the CPU kernel: x <= threshold is replaced, so NaN stays.
  Value replace = c.b.compare(x, operand(c, "threshold", o.compute, o.dims), hlo::Compare::LE);
  return {c.b.select(replace, operand(c, "value", o.compute, o.dims), x)};
}
std::vector<Value> lower_threshold_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value drop = c.b.compare(x, operand(c, "threshold", o.compute, o.dims), hlo::Compare::LE);  // NaN passes g
  return {c.b.select(drop, full(c.b, 0, g), g)};
}
std::vector<Value> lower_leaky_relu(Context& c) {
  Out o(c);
  Value x = in(c, o);
  Value slope = operand(c, "negative_slope", o.compute, o.dims);
  return {c.b.select(c.b.compare(x, full(c.b, 0, x), hlo::Compare::GT), x, c.b.binary("multiply", x, slope))};
}
std::vector<Value> lower_leaky_relu_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value slope = operand(c, "negative_slope", o.compute, o.dims);
  return {c.b.select(c.b.compare(x, full(c.b, 0, x), hlo::Compare::GT), g, c.b.binary("multiply", g, slope))};
}
std::vector<Value> lower_hardtanh(Context& c) {
  Out o(c);
  return {c.b.clamp(operand(c, "min_val", o.compute, o.dims), in(c, o), operand(c, "max_val", o.compute, o.dims))};
}
std::vector<Value> lower_hardtanh_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value inside = c.b.binary("and", c.b.compare(x, operand(c, "min_val", o.compute, o.dims), hlo::Compare::GT),
                            c.b.compare(x, operand(c, "max_val", o.compute, o.dims), hlo::Compare::LT));
  return {c.b.select(inside, g, full(c.b, 0, g))};
}
Value relu6_shifted(Builder& b, Value x) {  // clamp(x + 3, 0, 6) / 6
  Value y = b.clamp(full(b, 0, x), b.binary("add", x, full(b, 3, x)), full(b, 6, x));
  return b.binary("divide", y, full(b, 6, x));
}
std::vector<Value> lower_hardsigmoid(Context& c) {
  Out o(c);
  return {relu6_shifted(c.b, in(c, o))};
}
std::vector<Value> lower_hardswish(Context& c) {
  Out o(c);
  Value x = in(c, o);
  return {c.b.binary("multiply", x, relu6_shifted(c.b, x))};
}
std::vector<Value> lower_hardsigmoid_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value inside = c.b.binary("and", c.b.compare(x, full(c.b, -3, x), hlo::Compare::GT),
                            c.b.compare(x, full(c.b, 3, x), hlo::Compare::LT));
  return {c.b.select(inside, c.b.binary("divide", g, full(c.b, 6, g)), full(c.b, 0, g))};
}
std::vector<Value> lower_hardswish_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value mid = c.b.binary("multiply", g, c.b.binary("divide", c.b.binary("add", c.b.binary("multiply", full(c.b, 2, x), x), full(c.b, 3, x)), full(c.b, 6, x)));
  Value r = c.b.select(c.b.compare(x, full(c.b, 3, x), hlo::Compare::GT), g, mid);
  return {c.b.select(c.b.compare(x, full(c.b, -3, x), hlo::Compare::LT), full(c.b, 0, g), r)};
}
std::vector<Value> lower_softplus(Context& c) {
  Out o(c);
  Value x = in(c, o);
  Value beta = operand(c, "beta", o.compute, o.dims), th = operand(c, "threshold", o.compute, o.dims);
  Value bx = c.b.binary("multiply", x, beta);
  Value soft = c.b.binary("divide", c.b.unary("log_plus_one", c.b.unary("exponential", bx)), beta);
  return {c.b.select(c.b.compare(bx, th, hlo::Compare::GT), x, soft)};
}
std::vector<Value> lower_softplus_backward(Context& c) {
  Out o(c);
  Value g = in(c, o, "grad_output"), x = in(c, o);
  Value beta = operand(c, "beta", o.compute, o.dims), th = operand(c, "threshold", o.compute, o.dims);
  Value bx = c.b.binary("multiply", x, beta);
  Value s = c.b.unary("logistic", bx);
  return {c.b.select(c.b.compare(bx, th, hlo::Compare::GT), g, c.b.binary("multiply", g, s))};
}
std::vector<Value> lower_elu(Context& c) {
  Out o(c);
  Value x = in(c, o);
  Value alpha = operand(c, "alpha", o.compute, o.dims), scale = operand(c, "scale", o.compute, o.dims);
  Value input_scale = operand(c, "input_scale", o.compute, o.dims);
  Value neg = c.b.binary("multiply", alpha, c.b.unary("exponential_minus_one", c.b.binary("multiply", x, input_scale)));
  return {c.b.binary("multiply", scale, c.b.select(c.b.compare(x, full(c.b, 0, x), hlo::Compare::GT), x, neg))};
}

}  // namespace

// torch._assert_async(x[, msg]): the CPU raises when x's one value is zero (false), at once; here a runtime
// check, raised at the next wait with the same message, so an async assert (torchtitan's RoPE position bound)
// neither waits nor cuts the graph. Not one value: the CPU's "ambiguous" errors (it runs there).
std::vector<Value> lower_assert_async(Context& c) {
  Value x = c.tensor("self");
  if (x.type.element_count() != 1) throw Unsupported("_assert_async of a tensor without exactly one value");
  std::string message = "Expected Tensor with single nonzero value, but got zero";
  if (c.has("assert_msg")) {
    message = c.string_arg("assert_msg");
    // A check's message fills in "{}" and "{size}"; the user's text must stay as written.
    if (message.find("{}") != std::string::npos || message.find("{size}") != std::string::npos)
      throw Unsupported("_assert_async with '{}' in its message");
  }
  Builder& b = c.b;
  Value v = b.reshape(x, {});
  ElementType e = v.element();
  Value ok = e == ElementType::Pred ? v
             : b.compare(v, is_float(e) ? b.constant(0, e) : b.constant_int(0, e), hlo::Compare::NE);  // NaN: nonzero
  c.check(RuntimeCheck{ok, b.constant_int(0, ElementType::S64), CheckError::Runtime, message});
  return {};
}

void register_pointwise(Table& t) {
  add_lowering(t, "_assert_async", lower_assert_async);
  // kElementwise: the ops generation applies to its growing bookkeeping (a mask's `.bool()`, `masked_fill_`,
  // comparisons): no runtime checks (integer division has one), no use of the shape.
  add_lowerings(t, {
           {"abs", lower_abs, kComplex | kElementwise}, {"neg", lower_neg, kComplex | kElementwise}, {"exp", lower_exp, kComplex}, {"expm1", lower_expm1, kComplex}, {"log", lower_log, kComplex},
           {"log1p", lower_log1p, kComplex}, {"log2", lower_log2, kComplex}, {"log10", lower_log10, kComplex}, {"exp2", lower_exp2, kComplex},
           {"sqrt", lower_sqrt, kComplex}, {"rsqrt", lower_rsqrt, kComplex}, {"sin", lower_sin, kComplex}, {"cos", lower_cos, kComplex}, {"tan", lower_tan, kComplex},
           {"tanh", lower_tanh, kComplex}, {"sigmoid", lower_sigmoid, kComplex}, {"ceil", lower_ceil}, {"floor", lower_floor},
           {"round", lower_round}, {"sign", lower_sign}, {"sgn", lower_sign, kComplex}, {"asin", lower_asin, kComplex},
           {"acos", lower_acos, kComplex}, {"atan", lower_atan, kComplex}, {"sinh", lower_sinh, kComplex}, {"cosh", lower_cosh, kComplex},
           {"asinh", lower_asinh, kComplex}, {"acosh", lower_acosh, kComplex}, {"atanh", lower_atanh, kComplex}, {"erf", lower_erf},
           {"erfc", lower_erfc}, {"signbit", lower_signbit}, {"hypot", lower_hypot},
           {"erfinv", lower_erfinv}, {"lgamma", lower_lgamma}, {"digamma", lower_digamma},
           {"polygamma", lower_polygamma}, {"special_zeta", lower_zeta},
           {"reciprocal", lower_reciprocal, kComplex}, {"trunc", lower_trunc}, {"fix", lower_trunc}, {"frac", lower_frac},
           {"relu", lower_relu}, {"bitwise_not", lower_bitwise_not, kElementwise}, {"logical_not", lower_logical_not, kComplex | kElementwise},
           {"isnan", lower_isnan, kComplex}, {"isinf", lower_isinf, kComplex}, {"nan_to_num", lower_nan_to_num},
           {"add", lower_add, kComplex | kElementwise}, {"sub", lower_sub, kComplex | kElementwise}, {"rsub", lower_rsub, kComplex | kElementwise}, {"mul", lower_mul, kComplex | kElementwise}, {"div", lower_div, kComplex},
           {"floor_divide", lower_floor_divide}, {"remainder", lower_remainder}, {"fmod", lower_fmod},
           {"maximum", binary<k_maximum>, kElementwise}, {"minimum", binary<k_minimum>, kElementwise}, {"atan2", binary<k_atan2>},
           {"bitwise_and", bitwise<k_and>, kElementwise}, {"bitwise_left_shift", lower_bitwise_left_shift},
           {"bitwise_right_shift", lower_bitwise_right_shift}, {"bitwise_or", bitwise<k_or>, kElementwise}, {"bitwise_xor", bitwise<k_xor>, kElementwise},
           {"pow", lower_pow, kComplex}, {"fmax", lower_fmax}, {"fmin", lower_fmin}, {"logical_and", lower_logical_and, kComplex | kElementwise},
           {"logical_or", lower_logical_or, kComplex | kElementwise}, {"logical_xor", lower_logical_xor, kComplex | kElementwise},
           {"eq", compare<hlo::Compare::EQ>, kComplex | kElementwise}, {"ne", compare<hlo::Compare::NE>, kComplex | kElementwise}, {"lt", compare<hlo::Compare::LT>, kElementwise},
           {"le", compare<hlo::Compare::LE>, kElementwise}, {"gt", compare<hlo::Compare::GT>, kElementwise}, {"ge", compare<hlo::Compare::GE>, kElementwise},
           {"where", lower_where, kComplex | kElementwise}, {"clamp", lower_clamp}, {"clamp_min", lower_clamp_min},
           {"clamp_max", lower_clamp_max}, {"lerp", lower_lerp}, {"addcmul", lower_addcmul, kComplex},
           {"addcdiv", lower_addcdiv, kComplex}, {"masked_fill", lower_masked_fill, kComplex | kElementwise}, {"fill", lower_fill, kComplex | kElementwise},
           {"zero", lower_zero, kComplex | kElementwise}, {"copy", lower_copy, kComplex | kElementwise}, {"clone", lower_clone, kComplex | kElementwise}, {"_to_copy", lower_to_copy, kComplex | kElementwise},
           {"gelu", lower_gelu}, {"gelu_backward", lower_gelu_backward}, {"silu", lower_silu, kComplex},
           {"silu_backward", lower_silu_backward}, {"sigmoid_backward", lower_sigmoid_backward},
           {"tanh_backward", lower_tanh_backward}, {"threshold", lower_threshold},
           {"threshold_backward", lower_threshold_backward}, {"leaky_relu", lower_leaky_relu},
           {"leaky_relu_backward", lower_leaky_relu_backward}, {"hardtanh", lower_hardtanh},
           {"hardtanh_backward", lower_hardtanh_backward}, {"hardsigmoid", lower_hardsigmoid},
           {"hardswish", lower_hardswish}, {"hardsigmoid_backward", lower_hardsigmoid_backward},
           {"hardswish_backward", lower_hardswish_backward}, {"softplus", lower_softplus},
           {"softplus_backward", lower_softplus_backward}, {"elu", lower_elu}});
  for (const char* name : {"add", "sub", "rsub"}) rule(t, name).cpu(kAlphaCheck);
  // The CPU writes a constant into an overlapping output, and checks no overlap with the inputs.
  rule(t, "fill").internal_overlap_ok().inputs_overlap_unchecked();
  rule(t, "masked_fill").internal_overlap_ok().inputs_overlap_unchecked();
  rule(t, "zero").internal_overlap_ok();
  // Copies across devices go through _copy_from, and _to_copy may change device: PyTorch's generic kernels.
  for (const char* name : {"copy", "_to_copy"}) rule(t, name).route(Route::KeepGeneric);
}

}  // namespace torch_pjrt::lowering
