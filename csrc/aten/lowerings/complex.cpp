// Complex numbers: building and taking apart complex values (complex, polar,
// angle, conj_physical), the FFTs PyTorch's torch.fft reaches (_fft_c2c,
// _fft_r2c, _fft_c2r) on stablehlo.fft, and the list of lowerings of other
// families that handle complex values. Every other lowering is kept away from
// complex tensors by the executor (LoweringEntry::complex), so such ops run on
// the CPU rather than compute garbage.
#include <algorithm>
#include <cmath>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

std::vector<Value> lower_complex(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType part = real_part_type(o.element);
  return {c.b.complex(to(c.b, c.tensor("real"), part, o.dims), to(c.b, c.tensor("imag"), part, o.dims))};
}

std::vector<Value> lower_polar(Context& c) {
  const OutputMeta& o = c.output(0);
  ElementType part = real_part_type(o.element);
  Value r = to(c.b, c.tensor("abs"), part, o.dims), theta = to(c.b, c.tensor("angle"), part, o.dims);
  return {c.b.complex(c.b.binary("multiply", r, c.b.unary("cosine", theta)),
                      c.b.binary("multiply", r, c.b.unary("sine", theta)))};
}

// angle: atan2(imag, real); of a real x, pi where x < 0, else 0 (NaN stays NaN).
std::vector<Value> lower_angle(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = c.tensor("self");
  if (is_complex(x.element())) return {c.b.binary("atan2", c.b.imag(x), c.b.real(x))};
  ElementType e = widen(o.element);
  x = c.b.convert(x, e);
  Value zero = full(c.b, 0, x);
  Value r = c.b.select(c.b.compare(x, zero, hlo::Compare::LT), full(c.b, M_PI, x), zero);
  return {c.b.select(c.b.compare(x, x, hlo::Compare::NE), x, r)};
}

std::vector<Value> lower_conj_physical(Context& c) {
  const OutputMeta& o = c.output(0);
  return {c.b.conj(c.b.convert(c.tensor("self"), o.element))};
}

// ---- FFT ----

// x with `dims` moved last (in order) and the permutation that undoes it.
struct Moved {
  Value x;
  Dims back;
};
Moved move_last(Builder& b, const Value& x, const Dims& dims) {
  Dims perm;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) perm.push_back(d);
  perm.insert(perm.end(), dims.begin(), dims.end());
  Dims back(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) back[perm[i]] = static_cast<int64_t>(i);
  return {b.transpose(x, perm), back};
}

// An FFT of `type` over `dims` of x, one stablehlo.fft per dim (the op takes
// at most the 3 innermost dims; one dim at a time keeps this general).
Value fft_over(Builder& b, Value x, const Dims& dims, const char* type) {
  for (int64_t d : dims) {
    Moved m = move_last(b, x, {d});
    x = b.transpose(b.fft(m.x, type, {m.x.dims().back()}), m.back);
  }
  return x;
}

Dims fft_dims(Context& c, int64_t rank) {
  Dims dims = c.int_list("dim");
  for (auto& d : dims) d = wrap_dim(d, rank);
  return dims;
}

// PyTorch's normalization (0: none, 1: 1/sqrt(n), 2: 1/n) times `undo`, the
// factor that cancels XLA's own 1/n of an inverse transform.
Value normalize(Context& c, Value x, int64_t n, double undo) {
  int64_t mode = c.int_arg("normalization");
  double scale = mode == 0 ? 1.0 : mode == 1 ? 1.0 / std::sqrt(static_cast<double>(n)) : 1.0 / static_cast<double>(n);
  scale *= undo;
  if (scale == 1.0) return x;
  return c.b.binary("multiply", x, full(c.b, scale, x));
}

int64_t signal_size(const Dims& sizes, const Dims& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= sizes[d];
  return n;
}

std::vector<Value> lower_fft_c2c(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = c.b.convert(c.tensor("self"), o.element);
  Dims dims = fft_dims(c, x.rank());
  if (dims.empty()) return {x};
  bool forward = c.bool_arg("forward");
  int64_t n = signal_size(x.dims(), dims);
  Value y = fft_over(c.b, x, dims, forward ? "FFT" : "IFFT");
  return {normalize(c, y, n, forward ? 1.0 : static_cast<double>(n))};
}

// Real to complex: RFFT over the last of `dims` (halved when onesided), then
// complex FFTs over the others.
std::vector<Value> lower_fft_r2c(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = c.b.convert(c.tensor("self"), real_part_type(o.element));
  Dims dims = fft_dims(c, x.rank());
  if (dims.empty()) return {c.b.convert(x, o.element)};
  int64_t n = signal_size(x.dims(), dims);
  if (!c.bool_arg("onesided")) return {normalize(c, fft_over(c.b, c.b.convert(x, o.element), dims, "FFT"), n, 1.0)};
  int64_t last = dims.back();
  Moved m = move_last(c.b, x, {last});
  Value y = c.b.transpose(c.b.fft(m.x, "RFFT", {m.x.dims().back()}), m.back);
  y = fft_over(c.b, y, Dims(dims.begin(), dims.end() - 1), "FFT");
  return {normalize(c, y, n, 1.0)};
}

// Complex to real: inverse FFTs over all but the last of `dims`, then IRFFT of
// the last to `last_dim_size` points (its input cut or zero-padded to n/2+1).
std::vector<Value> lower_fft_c2r(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = c.b.convert(c.tensor("self"), complex_type_of(o.element));
  Dims dims = fft_dims(c, x.rank());
  if (dims.empty()) return {c.b.convert(x, o.element)};
  int64_t last = dims.back(), points = c.int_arg("last_dim_size");
  Dims others(dims.begin(), dims.end() - 1);
  Value y = fft_over(c.b, x, others, "IFFT");
  Moved m = move_last(c.b, y, {last});
  int64_t want = points / 2 + 1, have = m.x.dims().back();
  Value z = m.x;
  if (have > want) {
    Dims start(z.rank(), 0), limit = z.dims(), step(z.rank(), 1);
    limit.back() = want;
    z = c.b.slice(z, start, limit, step);
  } else if (have < want) {
    Dims low(z.rank(), 0), high(z.rank(), 0), interior(z.rank(), 0);
    high.back() = want - have;
    z = c.b.pad(z, c.b.constant(0, z.element()), low, high, interior);
  }
  Value r = c.b.transpose(c.b.fft(z, "IRFFT", {points}), m.back);
  int64_t n = signal_size(x.dims(), others) * points;
  return {normalize(c, c.b.convert(r, o.element), n, static_cast<double>(n))};
}

}  // namespace

void register_complex(Table& t) {
  // Lowerings of the other families right for complex values say so where they register (kComplex,
  // tests/python/test_complex.py). Comparisons other than eq/ne, rounding, NaN handling of max/min etc.
  // are not: those ops run on the CPU.
  add_lowerings(t, {{"complex", lower_complex, kComplex}, {"polar", lower_polar, kComplex},
                    {"angle", lower_angle, kComplex}, {"conj_physical", lower_conj_physical, kComplex},
                    {"_conj_physical", lower_conj_physical, kComplex}, {"_fft_c2c", lower_fft_c2c, kComplex},
                    {"_fft_r2c", lower_fft_r2c, kComplex}, {"_fft_c2r", lower_fft_c2r, kComplex}});
}

}  // namespace torch_pjrt::lowering
