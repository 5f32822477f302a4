// Neural-network ops: softmax/log_softmax, convolution, pooling, layer/batch/
// group norm, NLL loss, each with its backward. Math runs in f32 for f16/bf16
// inputs and is rounded once by the executor, as PyTorch's CPU kernels do.
#include <algorithm>
#include <functional>
#include <optional>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

using hlo::Compare;
using hlo::Reducer;

Value sum(Builder& b, Value x, const Dims& dims) { return b.reduce(x, b.constant(0, x.element()), dims, Reducer::Add); }
Value max_over(Builder& b, Value x, const Dims& dims) {
  return b.reduce(x, b.constant(-INFINITY, x.element()), dims, Reducer::Max);
}
Dims kept_dims(int64_t rank, const Dims& reduced) {
  Dims kept;
  for (int64_t d = 0; d < rank; ++d)
    if (std::find(reduced.begin(), reduced.end(), d) == reduced.end()) kept.push_back(d);
  return kept;
}
// A reduced value broadcast back over the dims it was reduced from.
Value expand(Builder& b, Value reduced, const Dims& dims, const Dims& reduced_dims) {
  return b.broadcast_in_dim(reduced, dims, kept_dims(static_cast<int64_t>(dims.size()), reduced_dims));
}
Value mul(Builder& b, Value x, Value y) { return b.binary("multiply", x, y); }
Value sub(Builder& b, Value x, Value y) { return b.binary("subtract", x, y); }
Value add(Builder& b, Value x, Value y) { return b.binary("add", x, y); }
Value div(Builder& b, Value x, Value y) { return b.binary("divide", x, y); }
Value input(Context& c, std::string_view name, ElementType e) { return c.b.convert(c.tensor(name), e); }

// ---- softmax ----

struct SoftmaxParts {
  Value shifted, sum_exp;  // x - max, and sum(exp(x - max)) broadcast
};
SoftmaxParts softmax_parts(Context& c, ElementType e) {
  Value x = input(c, "self", e);
  if (x.rank() == 0) x = c.b.reshape(x, {1});
  Dims dim{wrap_dim(c.int_arg("dim"), x.rank())};
  Value shifted = sub(c.b, x, expand(c.b, max_over(c.b, x, dim), x.dims(), dim));
  Value s = sum(c.b, c.b.unary("exponential", shifted), dim);
  return {shifted, expand(c.b, s, x.dims(), dim)};
}
std::vector<Value> lower_softmax(Context& c) {
  SoftmaxParts p = softmax_parts(c, widen(c.output(0).element));
  return {c.b.reshape(div(c.b, c.b.unary("exponential", p.shifted), p.sum_exp), c.output(0).dims)};
}
std::vector<Value> lower_log_softmax(Context& c) {
  SoftmaxParts p = softmax_parts(c, widen(c.output(0).element));
  return {c.b.reshape(sub(c.b, p.shifted, c.b.unary("log", p.sum_exp)), c.output(0).dims)};
}
// (grad_output, output, dim, input_dtype)
std::vector<Value> softmax_backward(Context& c, bool log) {
  ElementType e = widen(c.output(0).element);
  Value g = input(c, "grad_output", e), y = input(c, "output", e);
  if (g.rank() == 0) return {mul(c.b, g, full(c.b, 0, g))};
  Dims dim{wrap_dim(c.int_arg("dim"), g.rank())};
  if (log) return {sub(c.b, g, mul(c.b, c.b.unary("exponential", y), expand(c.b, sum(c.b, g, dim), g.dims(), dim)))};
  Value dot = expand(c.b, sum(c.b, mul(c.b, g, y), dim), g.dims(), dim);
  return {mul(c.b, y, sub(c.b, g, dot))};
}
std::vector<Value> lower_softmax_backward(Context& c) { return softmax_backward(c, false); }
std::vector<Value> lower_log_softmax_backward(Context& c) { return softmax_backward(c, true); }

// ---- convolution ----

Dims ones(size_t n) { return Dims(n, 1); }
Dims spatial_of(const Value& v) { return Dims(v.dims().begin() + 2, v.dims().end()); }
Dims repeat_to(Dims d, size_t n) {
  if (d.size() == 1 && n > 1) d.assign(n, d[0]);
  return d;
}

struct ConvParams {
  Dims stride, padding, dilation, output_padding;
  int64_t groups;
};
ConvParams conv_params(Context& c, size_t n) {
  return {repeat_to(c.int_list("stride"), n), repeat_to(c.int_list("padding"), n), repeat_to(c.int_list("dilation"), n),
          repeat_to(c.int_list("output_padding"), n), c.int_arg("groups")};
}

// The weight of a transposed convolution [I, O/g, k...] as the weight of the
// equivalent direct one [O, I/g, k...], spatially flipped.
Value transpose_weight(Builder& b, Value w, int64_t groups) {
  Dims d = w.dims();
  int64_t in = d[0], out_per_group = d[1];
  Dims grouped{groups, in / groups, out_per_group};
  grouped.insert(grouped.end(), d.begin() + 2, d.end());
  Dims perm{0, 2, 1};
  for (size_t i = 3; i < grouped.size(); ++i) perm.push_back(static_cast<int64_t>(i));
  Value t = b.transpose(b.reshape(w, grouped), perm);
  Dims flat{groups * out_per_group, in / groups};
  flat.insert(flat.end(), d.begin() + 2, d.end());
  Dims spatial;
  for (size_t i = 2; i < d.size(); ++i) spatial.push_back(static_cast<int64_t>(i));
  return b.reverse(b.reshape(t, flat), spatial);
}

// Direct convolution with output spatial size `out_spatial`.
Value conv(Builder& b, Value x, Value w, const Dims& out_spatial, const ConvParams& p) {
  Dims out{x.dims()[0], w.dims()[0]};
  out.insert(out.end(), out_spatial.begin(), out_spatial.end());
  return b.convolution(x, w, out, p.stride, p.padding, p.padding, ones(p.stride.size()), p.dilation, p.groups, 1,
                       widen(x.element()));
}

// The input-gradient of a direct convolution (= a transposed convolution):
// x dilated by the stride, convolved with the flipped, transposed weight.
Value conv_input_grad(Builder& b, Value g, Value w_direct, const Dims& in_spatial, const ConvParams& p) {
  size_t n = p.stride.size();
  Value w = transpose_weight(b, w_direct, p.groups);
  Dims low, high, gs = spatial_of(g), ks = spatial_of(w);
  for (size_t i = 0; i < n; ++i) {
    int64_t edge = p.dilation[i] * (ks[i] - 1);
    low.push_back(edge - p.padding[i]);
    // Whatever the forward's floor division dropped comes back as padding.
    int64_t produced = (gs[i] - 1) * p.stride[i] + 1 + low.back() + edge - p.padding[i] - edge;
    high.push_back(edge - p.padding[i] + (in_spatial[i] - produced));
  }
  Dims out{g.dims()[0], w.dims()[0]};
  out.insert(out.end(), in_spatial.begin(), in_spatial.end());
  return b.convolution(g, w, out, ones(n), low, high, p.stride, p.dilation, p.groups, 1, widen(g.element()));
}

// The weight-gradient of a direct convolution of x [N, C, ...] giving g [N, O, ...].
Value conv_weight_grad(Builder& b, Value x, Value g, const Dims& kernel, const ConvParams& p) {
  size_t n = p.stride.size();
  Dims swap{1, 0};
  for (size_t i = 0; i < n; ++i) swap.push_back(static_cast<int64_t>(i + 2));
  Value xt = b.transpose(x, swap), gt = b.transpose(g, swap);  // [C, N, ...], [O, N, ...]
  Dims high, xs = spatial_of(x), gs = spatial_of(g);
  for (size_t i = 0; i < n; ++i)
    high.push_back((kernel[i] - 1) * p.dilation[i] + (gs[i] - 1) * p.stride[i] + 1 - xs[i] - p.padding[i]);
  Dims out{x.dims()[1] / p.groups, g.dims()[1]};
  out.insert(out.end(), kernel.begin(), kernel.end());
  // Groups split the lhs batch (channels) and output features together.
  Value r = b.convolution(xt, gt, out, p.dilation, p.padding, high, ones(n), p.stride, 1, p.groups, widen(x.element()));
  return b.transpose(r, swap);
}

std::vector<Value> lower_convolution(Context& c) {
  // f16/bf16 inputs go in as they are; the convolution's result is f32 (see conv()).
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value x = input(c, "input", o.element), w = input(c, "weight", o.element);
  ConvParams p = conv_params(c, x.rank() - 2);
  Dims out_spatial(o.dims.begin() + 2, o.dims.end());
  Value y = c.bool_arg("transposed") ? conv_input_grad(c.b, x, w, out_spatial, p) : conv(c.b, x, w, out_spatial, p);
  if (c.has("bias")) y = add(c.b, y, c.b.broadcast_in_dim(input(c, "bias", e), y.dims(), {1}));
  return {y};
}

// (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask)
std::vector<Value> lower_convolution_backward(Context& c) {
  ElementType in = c.tensor_element("input"), e = widen(in);
  if (TensorType{e, c.tensor_dims("input")}.element_count() == 0) {
    // An empty input: the CPU's forward skipped the bias too, so all three are zeros.
    std::vector<Value> zeros;
    for (size_t i = 0; i < c.output_count(); ++i) zeros.push_back(c.b.constant(0, e, c.output(i).dims));
    return zeros;
  }
  Value g = input(c, "grad_output", in), x = input(c, "input", in), w = input(c, "weight", in);
  ConvParams p = conv_params(c, x.rank() - 2);
  Value gi, gw;
  if (c.bool_arg("transposed")) {
    gi = conv(c.b, g, w, spatial_of(x), p);
    gw = conv_weight_grad(c.b, g, x, spatial_of(w), p);
  } else {
    gi = conv_input_grad(c.b, g, w, spatial_of(x), p);
    gw = conv_weight_grad(c.b, x, g, spatial_of(w), p);
  }
  Dims not_channel = all_dims(g.rank());
  not_channel.erase(not_channel.begin() + 1);
  return {gi, gw, sum(c.b, c.b.convert(g, e), not_channel)};
}

// ---- pooling over the trailing spatial dims ----

struct Pool {
  size_t lead;  // batch/channel dims before the spatial ones
  Dims in, out, kernel, stride, pad, dilation, padded;
};
Pool pool_of(Context& c, const Dims& x_dims, const Dims& out_dims, size_t n) {
  Pool p;
  p.lead = x_dims.size() - n;
  p.in.assign(x_dims.begin() + p.lead, x_dims.end());
  p.out.assign(out_dims.begin() + p.lead, out_dims.end());
  p.kernel = repeat_to(c.int_list("kernel_size"), n);
  p.stride = c.int_list("stride").empty() ? p.kernel : repeat_to(c.int_list("stride"), n);
  p.pad = repeat_to(c.int_list("padding"), n);
  p.dilation = c.has("dilation") ? repeat_to(c.int_list("dilation"), n) : ones(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t reach = (p.out[i] - 1) * p.stride[i] + (p.kernel[i] - 1) * p.dilation[i] + 1;
    p.padded.push_back(std::max(reach, p.pad[i] + p.in[i]));
  }
  return p;
}
// Full dims of a value with the pool's lead dims and these spatial ones.
Dims with_spatial(const Dims& lead_from, size_t lead, const Dims& spatial) {
  Dims d(lead_from.begin(), lead_from.begin() + lead);
  d.insert(d.end(), spatial.begin(), spatial.end());
  return d;
}
Value pad_input(Builder& b, Value x, double value, const Pool& p) {
  Dims low(p.lead, 0), high(p.lead, 0);
  for (size_t i = 0; i < p.in.size(); ++i) {
    low.push_back(p.pad[i]);
    high.push_back(p.padded[i] - p.pad[i] - p.in[i]);
  }
  return b.pad(x, b.constant(value, x.element()), low, high, Dims(low.size(), 0));
}
// Calls fn(slice start per spatial dim) for every kernel offset.
void for_each_offset(const Pool& p, const std::function<void(const Dims&)>& fn) {
  size_t n = p.kernel.size();
  Dims k(n, 0);
  while (true) {
    Dims start;
    for (size_t i = 0; i < n; ++i) start.push_back(k[i] * p.dilation[i]);
    fn(start);
    size_t i = n;
    while (i > 0 && ++k[i - 1] == p.kernel[i - 1]) k[--i] = 0;
    if (i == 0) return;
  }
}
// The elements that window offset `start` sees, one per output position.
Value window_slice(Builder& b, Value padded, const Pool& p, const Dims& start) {
  Dims s(p.lead, 0), limit(padded.dims().begin(), padded.dims().begin() + p.lead), strides(p.lead, 1);
  for (size_t i = 0; i < start.size(); ++i) {
    s.push_back(start[i]);
    limit.push_back(start[i] + (p.out[i] - 1) * p.stride[i] + 1);
    strides.push_back(p.stride[i]);
  }
  return b.slice(padded, s, limit, strides);
}
// The transpose of window_slice: puts output-shaped `v` back at its positions
// in padded-input space (zeros elsewhere).
Value window_unslice(Builder& b, Value v, const Pool& p, const Dims& start) {
  Dims low(p.lead, 0), high(p.lead, 0), interior(p.lead, 0);
  for (size_t i = 0; i < start.size(); ++i) {
    low.push_back(start[i]);
    high.push_back(p.padded[i] - start[i] - (p.out[i] - 1) * p.stride[i] - 1);
    interior.push_back(p.stride[i] - 1);
  }
  return b.pad(v, b.constant(0, v.element()), low, high, interior);
}
// Padded-input space back to the input's own extent.
Value unpad(Builder& b, Value v, const Pool& p) {
  Dims s(p.lead, 0), limit(v.dims().begin(), v.dims().begin() + p.lead), strides(v.rank(), 1);
  for (size_t i = 0; i < p.in.size(); ++i) {
    s.push_back(p.pad[i]);
    limit.push_back(p.pad[i] + p.in[i]);
  }
  return b.slice(v, s, limit, strides);
}
// Row-major position of each element within its spatial plane (max-pool indices).
Value spatial_positions(Builder& b, const Dims& dims, size_t lead) {
  Value pos = b.constant_int(0, ElementType::S64, dims);
  int64_t scale = 1;
  for (size_t i = dims.size(); i-- > lead;) {
    Value along = b.iota(TensorType{ElementType::S64, dims}, static_cast<int64_t>(i));
    pos = add(b, pos, mul(b, along, b.constant_int(scale, ElementType::S64, dims)));
    scale *= dims[i];
  }
  return pos;
}

// max_pool{1,2,3}d_with_indices: values and flat spatial indices. As the CPU
// kernel (`val > max || isnan(val)`): ties keep the first position, and the
// last NaN in a window wins. One variadic reduce_window (an unrolled loop over
// kernel offsets made programs that XLA compiles for minutes with large
// kernels); padding never wins (its index is the largest).
std::vector<Value> max_pool(Context& c, size_t n) {
  Value x = c.tensor("self");
  Pool p = pool_of(c, x.dims(), c.output(0).dims, n);
  double lowest = is_float(x.element()) ? -INFINITY : -9.2e18;
  Value xp = pad_input(c.b, x, lowest, p);
  Value ip = pad_input(c.b, spatial_positions(c.b, x.dims(), p.lead), 9.2e18, p);
  Dims window = with_spatial(Dims(p.lead, 1), p.lead, p.kernel), strides = with_spatial(Dims(p.lead, 1), p.lead, p.stride);
  Dims dilations = with_spatial(Dims(p.lead, 1), p.lead, p.dilation);
  auto r = c.b.reduce_window_max_arg(xp, ip, c.b.constant(lowest, x.element()),
                                     c.b.constant_int(INT64_MAX, ElementType::S64), window, strides, dilations);
  Dims out = with_spatial(x.dims(), p.lead, p.out);
  Dims zero(out.size(), 0), step(out.size(), 1);
  return {c.b.slice(r[0], zero, out, step), c.b.slice(r[1], zero, out, step)};
}
std::vector<Value> lower_max_pool2d(Context& c) { return max_pool(c, 2); }
std::vector<Value> lower_max_pool3d(Context& c) { return max_pool(c, 3); }

// (grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices)
// As on CPU: each output's gradient is added at its recorded input position
// (one scatter over [lead, spatial] planes).
std::vector<Value> max_pool_backward(Context& c, size_t n) {
  ElementType e = widen(c.output(0).element);
  Value g = input(c, "grad_output", e), indices = c.b.convert(c.tensor("indices"), ElementType::S64);
  Dims x_dims = c.tensor_dims("self");
  size_t lead = x_dims.size() - n;
  int64_t planes = 1, plane = 1, outs = 1;
  for (size_t i = 0; i < x_dims.size(); ++i) (i < lead ? planes : plane) *= x_dims[i];
  for (size_t i = lead; i < g.dims().size(); ++i) outs *= g.dims()[i];
  Value updates = c.b.reshape(g, {planes, outs});
  Value at = c.b.reshape(indices, {planes, outs, 1});
  Value plane_of = c.b.iota(TensorType{ElementType::S64, {planes, outs, 1}}, 0);
  Value where = c.b.concatenate({plane_of, at}, 2);
  Builder::ScatterDims dn{{}, {0, 1}, {}, {}, {0, 1}, 2};
  Value acc = c.b.scatter(c.b.constant(0, e, {planes, plane}), where, updates, dn, Reducer::Add);
  return {c.b.reshape(acc, x_dims)};
}
std::vector<Value> lower_max_pool2d_backward(Context& c) { return max_pool_backward(c, 2); }
std::vector<Value> lower_max_pool3d_backward(Context& c) { return max_pool_backward(c, 3); }

// How many elements each window averages over, per output position.
Value avg_divisor(Context& c, const Pool& p, const Dims& out_dims, ElementType e) {
  if (c.has("divisor_override")) return c.b.constant(static_cast<double>(c.int_arg("divisor_override")), e, out_dims);
  bool include_pad = c.bool_arg("count_include_pad");
  // 1 where a padded-space position counts: inside the input, or inside the
  // user's padding when count_include_pad (ceil_mode's extra edge never counts).
  Dims spatial_dims = p.padded;
  Value mask = c.b.constant(1, e, spatial_dims);
  for (size_t i = 0; i < p.in.size(); ++i) {
    Value pos = c.b.iota(TensorType{ElementType::S64, spatial_dims}, static_cast<int64_t>(i));
    int64_t lo = include_pad ? 0 : p.pad[i], hi = include_pad ? p.in[i] + 2 * p.pad[i] : p.pad[i] + p.in[i];
    Value inside = c.b.binary("and", c.b.compare(pos, c.b.constant_int(lo, ElementType::S64, spatial_dims), Compare::GE),
                              c.b.compare(pos, c.b.constant_int(hi, ElementType::S64, spatial_dims), Compare::LT));
    mask = c.b.select(inside, mask, c.b.constant(0, e, spatial_dims));
  }
  Pool spatial_only = p;
  spatial_only.lead = 0;
  std::optional<Value> count;
  for_each_offset(spatial_only, [&](const Dims& start) {
    Value v = window_slice(c.b, mask, spatial_only, start);
    count = count ? add(c.b, *count, v) : v;
  });
  Dims map;
  for (size_t i = 0; i < p.in.size(); ++i) map.push_back(static_cast<int64_t>(p.lead + i));
  return c.b.broadcast_in_dim(*count, out_dims, map);
}

std::vector<Value> avg_pool(Context& c, size_t n) {
  const OutputMeta& o = c.output(0);
  ElementType e = widen(o.element);
  Value x = input(c, "self", e);
  Pool p = pool_of(c, x.dims(), o.dims, n);
  Value xp = pad_input(c.b, x, 0, p);
  std::optional<Value> total;
  for_each_offset(p, [&](const Dims& start) {
    Value v = window_slice(c.b, xp, p, start);
    total = total ? add(c.b, *total, v) : v;
  });
  return {div(c.b, *total, avg_divisor(c, p, o.dims, e))};
}
std::vector<Value> lower_avg_pool2d(Context& c) { return avg_pool(c, 2); }
std::vector<Value> lower_avg_pool3d(Context& c) { return avg_pool(c, 3); }

std::vector<Value> avg_pool_backward(Context& c, size_t n) {
  ElementType e = widen(c.output(0).element);
  Value g = input(c, "grad_output", e);
  Dims x_dims = c.tensor_dims("self");
  Pool p = pool_of(c, x_dims, g.dims(), n);
  Value scaled = div(c.b, g, avg_divisor(c, p, g.dims(), e));
  Value acc = c.b.constant(0, e, with_spatial(x_dims, p.lead, p.padded));
  for_each_offset(p, [&](const Dims& start) { acc = add(c.b, acc, window_unslice(c.b, scaled, p, start)); });
  return {unpad(c.b, acc, p)};
}
std::vector<Value> lower_avg_pool2d_backward(Context& c) { return avg_pool_backward(c, 2); }
std::vector<Value> lower_avg_pool3d_backward(Context& c) { return avg_pool_backward(c, 3); }

// Adaptive average pooling. Output cell r along a dim of size n -> o covers
// inputs [floor(r*n/o), ceil((r+1)*n/o)). Equal blocks (o divides n) are a
// reshape and a sum; other sizes contract each spatial dim with an [o, n]
// averaging matrix, built from iotas.
struct Blocks {
  Dims split;  // [lead..., o0, k0, o1, k1, ...]
  Dims block_dims, out;
  double cells = 1;
};
std::optional<Blocks> blocks_of(const Dims& in, const Dims& out_spatial) {
  Blocks bl;
  size_t lead = in.size() - out_spatial.size();
  bl.split.assign(in.begin(), in.begin() + lead);
  bl.out = bl.split;
  for (size_t i = 0; i < out_spatial.size(); ++i) {
    int64_t o = out_spatial[i], n = in[lead + i];
    if (o == 0 || n % o != 0) return std::nullopt;
    bl.split.push_back(o);
    bl.split.push_back(n / o);
    bl.block_dims.push_back(static_cast<int64_t>(lead + 2 * i + 1));
    bl.out.push_back(o);
    bl.cells *= static_cast<double>(n / o);
  }
  return bl;
}
// W[r, j] = 1 / |cell r| where input j is in output cell r, else 0.
Value averaging_matrix(Builder& b, int64_t n, int64_t o, ElementType e) {
  const ElementType i64 = ElementType::S64;
  Value rows = b.iota({i64, {o, n}}, 0), cols = b.iota({i64, {o, n}}, 1);
  auto k = [&](int64_t v) { return b.constant_int(v, i64, {o, n}); };
  Value start = b.binary("divide", b.binary("multiply", rows, k(n)), k(o));
  Value end = b.binary("divide", b.binary("add", b.binary("multiply", b.binary("add", rows, k(1)), k(n)), k(o - 1)), k(o));
  Value inside = b.select(b.compare(cols, start, Compare::GE), b.compare(cols, end, Compare::LT),
                          b.constant_bool(false, {o, n}));
  Value weight = div(b, b.constant(1, e, {o, n}), b.convert(b.binary("subtract", end, start), e));
  return b.select(inside, weight, b.constant(0, e, {o, n}));
}
// Contracts the first spatial dim (at `lead`) with `matrix_dim` of each matrix
// in turn; the new dim lands last, so the spatial order is kept.
Value contract_spatial(Builder& b, Value x, size_t lead, const std::vector<Value>& matrices, int64_t matrix_dim) {
  for (const Value& m : matrices)
    x = b.dot_general(x, m, {}, {}, {static_cast<int64_t>(lead)}, {matrix_dim}, x.element());
  return x;
}
std::vector<Value> averaging_matrices(Builder& b, const Dims& in, const Dims& out_spatial, ElementType e) {
  size_t lead = in.size() - out_spatial.size();
  std::vector<Value> matrices;
  for (size_t i = 0; i < out_spatial.size(); ++i) {
    if (out_spatial[i] == 0) throw Unsupported("adaptive pooling to an empty output");
    matrices.push_back(averaging_matrix(b, in[lead + i], out_spatial[i], e));
  }
  return matrices;
}
std::vector<Value> lower_adaptive_avg_pool(Context& c) {
  const OutputMeta& o = c.output(0);
  Value x = input(c, "self", widen(o.element));
  Dims out_spatial = c.int_list("output_size");
  if (auto bl = blocks_of(x.dims(), out_spatial)) {
    Value s = sum(c.b, c.b.reshape(x, bl->split), bl->block_dims);
    return {div(c.b, s, full(c.b, bl->cells, s))};
  }
  size_t lead = x.dims().size() - out_spatial.size();
  return {contract_spatial(c.b, x, lead, averaging_matrices(c.b, x.dims(), out_spatial, x.element()), 1)};
}
std::vector<Value> adaptive_avg_pool_backward(Context& c, size_t n) {
  ElementType e = widen(c.output(0).element);
  Value g = input(c, "grad_output", e);
  Dims x_dims = c.tensor_dims("self");
  Dims out_spatial(g.dims().end() - static_cast<int64_t>(n), g.dims().end());
  if (auto bl = blocks_of(x_dims, out_spatial)) {
    Dims kept = kept_dims(static_cast<int64_t>(bl->split.size()), bl->block_dims);
    Value spread = c.b.broadcast_in_dim(div(c.b, g, full(c.b, bl->cells, g)), bl->split, kept);
    return {c.b.reshape(spread, x_dims)};
  }
  return {contract_spatial(c.b, g, x_dims.size() - n, averaging_matrices(c.b, x_dims, out_spatial, e), 0)};
}
std::vector<Value> lower_adaptive_avg_pool2d_backward(Context& c) { return adaptive_avg_pool_backward(c, 2); }
std::vector<Value> lower_adaptive_avg_pool3d_backward(Context& c) { return adaptive_avg_pool_backward(c, 3); }

// ---- normalization ----

// The input-gradient shared by every normalization over `dims`:
// rstd * (gy - mean(gy) - xhat * mean(gy * xhat)), gy = grad * weight.
Value normalized_input_grad(Builder& b, Value gy, Value xhat, Value rstd_b, const Dims& dims) {
  double n = 1;
  for (int64_t d : dims) n *= static_cast<double>(gy.dims()[d]);
  Value total = sum(b, gy, dims), proj = sum(b, mul(b, gy, xhat), dims);
  Value mean_gy = expand(b, div(b, total, full(b, n, total)), gy.dims(), dims);
  Value mean_proj = expand(b, div(b, proj, full(b, n, proj)), gy.dims(), dims);
  return mul(b, rstd_b, sub(b, sub(b, gy, mean_gy), mul(b, xhat, mean_proj)));
}

struct Stats {
  Value mean, var;  // reduced over `dims`
};
Stats stats(Builder& b, Value x, const Dims& dims) {
  double n = 1;
  for (int64_t d : dims) n *= static_cast<double>(x.dims()[d]);
  Value s = sum(b, x, dims);
  Value mean = div(b, s, full(b, n, s));
  Value centered = sub(b, x, expand(b, mean, x.dims(), dims));
  Value ss = sum(b, mul(b, centered, centered), dims);
  return {mean, div(b, ss, full(b, n, ss))};
}
Value rsqrt_eps(Builder& b, Value var, double eps) { return b.unary("rsqrt", add(b, var, full(b, eps, var))); }

// native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)
std::vector<Value> lower_layer_norm(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value x = input(c, "input", e);
  int64_t axis = x.rank() - static_cast<int64_t>(c.int_list("normalized_shape").size());
  Dims dims;
  for (int64_t d = axis; d < x.rank(); ++d) dims.push_back(d);
  Stats s = stats(c.b, x, dims);
  Value rstd = rsqrt_eps(c.b, s.var, c.float_arg("eps"));
  Value y = mul(c.b, sub(c.b, x, expand(c.b, s.mean, x.dims(), dims)), expand(c.b, rstd, x.dims(), dims));
  Dims trailing = dims;
  if (c.has("weight")) y = mul(c.b, y, c.b.broadcast_in_dim(input(c, "weight", e), x.dims(), trailing));
  if (c.has("bias")) y = add(c.b, y, c.b.broadcast_in_dim(input(c, "bias", e), x.dims(), trailing));
  return {y, c.b.reshape(s.mean, c.output(1).dims), c.b.reshape(rstd, c.output(2).dims)};
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
std::vector<Value> lower_layer_norm_backward(Context& c) {
  ElementType e = widen(c.tensor_element("input"));
  Value g = input(c, "grad_out", e), x = input(c, "input", e);
  int64_t axis = x.rank() - static_cast<int64_t>(c.int_list("normalized_shape").size());
  Dims dims, lead;
  for (int64_t d = 0; d < x.rank(); ++d) (d >= axis ? dims : lead).push_back(d);
  Dims stat_dims(x.dims().begin(), x.dims().begin() + axis);
  Value mean = c.b.reshape(input(c, "mean", e), stat_dims), rstd = c.b.reshape(input(c, "rstd", e), stat_dims);
  Value rstd_b = expand(c.b, rstd, x.dims(), dims);
  Value xhat = mul(c.b, sub(c.b, x, expand(c.b, mean, x.dims(), dims)), rstd_b);
  Value gy = c.has("weight") ? mul(c.b, g, c.b.broadcast_in_dim(input(c, "weight", e), x.dims(), dims)) : g;
  return {normalized_input_grad(c.b, gy, xhat, rstd_b, dims), sum(c.b, mul(c.b, g, xhat), lead), sum(c.b, g, lead)};
}

Dims all_but_channel(int64_t rank) {
  Dims d;
  for (int64_t i = 0; i < rank; ++i)
    if (i != 1) d.push_back(i);
  return d;
}
Value per_channel(Builder& b, Value v, const Dims& dims) { return b.broadcast_in_dim(v, dims, {1}); }

// native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
//   -> (out, save_mean, save_invstd), then the updated running_mean/var when given.
std::vector<Value> lower_batch_norm(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value x = input(c, "input", e);
  Dims dims = all_but_channel(x.rank());
  double eps = c.float_arg("eps"), momentum = c.float_arg("momentum");
  bool training = c.has("training") && c.bool_arg("training");  // _native_batch_norm_legit_no_training has none
  bool has_running = c.has("running_mean") && c.has("running_var");
  std::optional<Value> rm, rv;
  if (c.has("running_mean")) rm = input(c, "running_mean", e);
  if (c.has("running_var")) rv = input(c, "running_var", e);
  Value mean, invstd, var;
  if (training || !has_running) {
    Stats s = stats(c.b, x, dims);
    mean = s.mean;
    var = s.var;
  } else {
    mean = *rm;
    var = *rv;
  }
  invstd = rsqrt_eps(c.b, var, eps);
  Value y = mul(c.b, sub(c.b, x, per_channel(c.b, mean, x.dims())), per_channel(c.b, invstd, x.dims()));
  if (c.has("weight")) y = mul(c.b, y, per_channel(c.b, input(c, "weight", e), x.dims()));
  if (c.has("bias")) y = add(c.b, y, per_channel(c.b, input(c, "bias", e), x.dims()));
  // Eval mode saves nothing (empty tensors on the CPU) and leaves the running stats.
  // The saved stats in the meta kernel's dtype: float32 for native_batch_norm, the input's for its functional forms.
  auto saved = [&](const Value& v, size_t k) {
    const OutputMeta& m = c.output(k);
    return training ? c.b.convert(c.b.reshape(v, m.dims), m.element) : c.b.constant(0, m.element, m.dims);
  };
  std::vector<Value> out{c.b.convert(y, c.output(0).element), saved(mean, 1), saved(invstd, 2)};
  double n = static_cast<double>(x.type.element_count() / std::max<int64_t>(1, x.dims()[1]));
  auto update = [&](Value running, Value batch) {
    if (!training) return running;
    return add(c.b, mul(c.b, running, full(c.b, 1 - momentum, running)), mul(c.b, batch, full(c.b, momentum, batch)));
  };
  if (rm) out.push_back(c.b.convert(update(*rm, mean), c.tensor_element("running_mean")));
  if (rv)
    out.push_back(c.b.convert(update(*rv, mul(c.b, var, full(c.b, n / std::max(1.0, n - 1), var))),
                              c.tensor_element("running_var")));
  return out;
}

// Inference batch norm (torch.compile's eval graphs): the running stats are read, never written.
std::vector<Value> lower_batch_norm_no_training(Context& c) {
  std::vector<Value> out = lower_batch_norm(c);
  out.resize(3);
  return out;
}

// native_batch_norm_backward(grad_out, input, weight, running_mean, running_var,
//   save_mean, save_invstd, train, eps, output_mask)
std::vector<Value> lower_batch_norm_backward(Context& c) {
  ElementType e = widen(c.tensor_element("input"));
  Value g = input(c, "grad_out", e), x = input(c, "input", e);
  Dims dims = all_but_channel(x.rank());
  bool train = c.bool_arg("train");
  Value mean = train ? input(c, "save_mean", e) : input(c, "running_mean", e);
  Value invstd = train ? input(c, "save_invstd", e) : rsqrt_eps(c.b, input(c, "running_var", e), c.float_arg("eps"));
  Value invstd_b = per_channel(c.b, invstd, x.dims());
  Value xhat = mul(c.b, sub(c.b, x, per_channel(c.b, mean, x.dims())), invstd_b);
  Value gy = c.has("weight") ? mul(c.b, g, per_channel(c.b, input(c, "weight", e), x.dims())) : g;
  Value gi = train ? normalized_input_grad(c.b, gy, xhat, invstd_b, dims) : mul(c.b, gy, invstd_b);
  return {gi, sum(c.b, mul(c.b, g, xhat), dims), sum(c.b, g, dims)};
}

// native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)
struct Groups {
  Dims grouped;   // [N, G, C/G * HxW]
  Dims channels;  // [N, C, HxW]
};
Groups groups_of(Context& c) {
  int64_t n = c.int_arg("N"), ch = c.int_arg("C"), hw = c.int_arg("HxW"), g = c.int_arg("group");
  return {{n, g, ch / g * hw}, {n, ch, hw}};
}
std::vector<Value> lower_group_norm(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value x = input(c, "input", e);
  Groups gr = groups_of(c);
  Value x3 = c.b.reshape(x, gr.grouped);
  Stats s = stats(c.b, x3, {2});
  Value rstd = rsqrt_eps(c.b, s.var, c.float_arg("eps"));
  Value y = c.b.reshape(mul(c.b, sub(c.b, x3, expand(c.b, s.mean, gr.grouped, {2})), expand(c.b, rstd, gr.grouped, {2})),
                        gr.channels);
  if (c.has("weight")) y = mul(c.b, y, per_channel(c.b, input(c, "weight", e), gr.channels));
  if (c.has("bias")) y = add(c.b, y, per_channel(c.b, input(c, "bias", e), gr.channels));
  return {c.b.reshape(y, x.dims()), s.mean, rstd};
}
// native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)
std::vector<Value> lower_group_norm_backward(Context& c) {
  ElementType e = widen(c.tensor_element("input"));
  Groups gr = groups_of(c);
  Value x3 = c.b.reshape(input(c, "input", e), gr.grouped), g = c.b.reshape(input(c, "grad_out", e), gr.channels);
  Value rstd_b = expand(c.b, input(c, "rstd", e), gr.grouped, {2});
  Value xhat3 = mul(c.b, sub(c.b, x3, expand(c.b, input(c, "mean", e), gr.grouped, {2})), rstd_b);
  Value gy = c.has("weight") ? mul(c.b, g, per_channel(c.b, input(c, "weight", e), gr.channels)) : g;
  Value gi = normalized_input_grad(c.b, c.b.reshape(gy, gr.grouped), xhat3, rstd_b, {2});
  Value xhat = c.b.reshape(xhat3, gr.channels);
  return {c.b.reshape(gi, c.tensor_dims("input")), sum(c.b, mul(c.b, g, xhat), {0, 2}), sum(c.b, g, {0, 2})};
}

// ---- NLL loss (cross_entropy is log_softmax + nll_loss) ----

struct Nll {
  Value picked_mask;  // one-hot of the target along the class dim (pred)
  Value weight;       // per-target weight, 0 where ignored; target dims
  int64_t class_dim;
};
Nll nll_parts(Context& c, const Value& x) {
  Nll n;
  n.class_dim = x.rank() == 1 ? 0 : 1;
  Value target = c.b.convert(c.tensor("target"), ElementType::S64);
  Dims keep = kept_dims(x.rank(), {n.class_dim});
  Value classes = c.b.iota(TensorType{ElementType::S64, x.dims()}, n.class_dim);
  n.picked_mask = c.b.compare(classes, c.b.broadcast_in_dim(target, x.dims(), keep), Compare::EQ);
  Value w;
  if (c.has("weight")) {
    Value wb = c.b.broadcast_in_dim(input(c, "weight", x.element()), x.dims(), {n.class_dim});
    w = sum(c.b, c.b.select(n.picked_mask, wb, zeros_like(c.b, wb)), {n.class_dim});
  } else {
    w = c.b.constant(1, x.element(), target.dims());
  }
  Value ignore = c.b.constant_int(c.int_arg("ignore_index"), ElementType::S64, target.dims());
  Value kept = c.b.compare(target, ignore, Compare::NE);
  n.weight = c.b.select(kept, w, zeros_like(c.b, w));
  // A target outside [0, classes) picks nothing here; the CPU raises.
  check_in_range(c, c.b.select(kept, target, zeros_like(c.b, target)), x.dims()[n.class_dim], false,
                 CheckError::Index, "Target {} is out of bounds.");
  return n;
}
// (self, target, weight, reduction, ignore_index) -> (output, total_weight)
std::vector<Value> lower_nll_loss(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value x = input(c, "self", e);
  Nll n = nll_parts(c, x);
  Value picked = sum(c.b, c.b.select(n.picked_mask, x, zeros_like(c.b, x)), {n.class_dim});
  Value losses = c.b.unary("negate", mul(c.b, picked, n.weight));
  Value total = sum(c.b, n.weight, all_dims(n.weight.rank()));
  int64_t reduction = c.int_arg("reduction");
  if (reduction == 0) return {losses, total};
  Value s = sum(c.b, losses, all_dims(losses.rank()));
  return {reduction == 1 ? div(c.b, s, total) : s, total};
}
// (grad_output, self, target, weight, reduction, ignore_index, total_weight)
std::vector<Value> lower_nll_loss_backward(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value x = input(c, "self", e);
  Nll n = nll_parts(c, x);
  Value g = input(c, "grad_output", e);
  int64_t reduction = c.int_arg("reduction");
  if (reduction == 1) g = div(c.b, g, input(c, "total_weight", e));
  Value scale = reduction == 0 ? mul(c.b, g, n.weight)
                               : mul(c.b, c.b.broadcast_in_dim(g, n.weight.dims(), {}), n.weight);
  Value spread = c.b.broadcast_in_dim(c.b.unary("negate", scale), x.dims(), kept_dims(x.rank(), {n.class_dim}));
  return {c.b.select(n.picked_mask, spread, zeros_like(c.b, x))};
}

// ---- fused RNN cells (what ATen's LSTM/GRU code calls on this device) ----
// Gate layouts follow the CUDA kernels: LSTM gates [i, f, g, o], workspace
// [i, f, g, o] after their activations; GRU gates [r, z, n], workspace
// [r, z, n, hx, hn].

// Chunk k of n equal chunks along the last dim.
Value chunk(Builder& b, Value x, int64_t k, int64_t n) {
  Dims start(x.rank(), 0), limit = x.dims(), strides(x.rank(), 1);
  int64_t size = x.dims().back() / n;
  start.back() = k * size;
  limit.back() = (k + 1) * size;
  return b.slice(x, start, limit, strides);
}
Value concat_last(Builder& b, const std::vector<Value>& parts) { return b.concatenate(parts, parts[0].rank() - 1); }
Value with_bias(Context& c, Value gates, std::string_view bias, ElementType e) {
  if (!c.has(bias)) return gates;
  return add(c.b, gates, c.b.broadcast_in_dim(input(c, bias, e), gates.dims(), {gates.rank() - 1}));
}
// Summed over every dim but the last (the batch), as a bias gradient.
Value bias_grad(Builder& b, Value g) {
  Dims batch = all_dims(g.rank());
  batch.pop_back();
  return sum(b, g, batch);
}
Value one_minus(Builder& b, Value x) { return sub(b, full(b, 1, x), x); }
Value sigmoid_grad(Builder& b, Value y) { return mul(b, one_minus(b, y), y); }  // from the sigmoid's output
Value tanh_grad(Builder& b, Value y) { return one_minus(b, mul(b, y, y)); }     // from the tanh's output

// (input_gates, hidden_gates, cx, input_bias, hidden_bias) -> (hy, cy, workspace)
std::vector<Value> lower_lstm_cell(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value gates = add(c.b, input(c, "input_gates", e), input(c, "hidden_gates", e));
  gates = with_bias(c, with_bias(c, gates, "input_bias", e), "hidden_bias", e);
  Value i = c.b.unary("logistic", chunk(c.b, gates, 0, 4)), f = c.b.unary("logistic", chunk(c.b, gates, 1, 4));
  Value g = c.b.unary("tanh", chunk(c.b, gates, 2, 4)), o = c.b.unary("logistic", chunk(c.b, gates, 3, 4));
  Value cy = add(c.b, mul(c.b, f, input(c, "cx", e)), mul(c.b, i, g));
  Value hy = mul(c.b, o, c.b.unary("tanh", cy));
  return {hy, cy, concat_last(c.b, {i, f, g, o})};
}
// (grad_hy?, grad_cy?, cx, cy, workspace, has_bias) -> (grad_gates, grad_cx, grad_bias?)
std::vector<Value> lower_lstm_cell_backward(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value cx = input(c, "cx", e), cy = input(c, "cy", e), ws = input(c, "workspace", e);
  Value i = chunk(c.b, ws, 0, 4), f = chunk(c.b, ws, 1, 4), g = chunk(c.b, ws, 2, 4), o = chunk(c.b, ws, 3, 4);
  Value go = c.has("grad_hy") ? input(c, "grad_hy", e) : zeros_like(c.b, cx);
  Value gc = c.has("grad_cy") ? input(c, "grad_cy", e) : zeros_like(c.b, cx);
  Value tanh_cy = c.b.unary("tanh", cy);
  Value gcy = add(c.b, mul(c.b, mul(c.b, go, o), tanh_grad(c.b, tanh_cy)), gc);  // total gradient of cy
  Value gi = mul(c.b, mul(c.b, gcy, g), sigmoid_grad(c.b, i));
  Value gf = mul(c.b, mul(c.b, gcy, cx), sigmoid_grad(c.b, f));
  Value gg = mul(c.b, mul(c.b, gcy, i), tanh_grad(c.b, g));
  Value gout = mul(c.b, mul(c.b, go, tanh_cy), sigmoid_grad(c.b, o));
  Value grad_gates = concat_last(c.b, {gi, gf, gg, gout});
  return {grad_gates, mul(c.b, gcy, f), bias_grad(c.b, grad_gates)};
}
// (input_gates, hidden_gates, hx, input_bias, hidden_bias) -> (hy, workspace)
std::vector<Value> lower_gru_cell(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value in = with_bias(c, input(c, "input_gates", e), "input_bias", e);
  Value hid = with_bias(c, input(c, "hidden_gates", e), "hidden_bias", e);
  Value hx = input(c, "hx", e);
  Value r = c.b.unary("logistic", add(c.b, chunk(c.b, in, 0, 3), chunk(c.b, hid, 0, 3)));
  Value z = c.b.unary("logistic", add(c.b, chunk(c.b, in, 1, 3), chunk(c.b, hid, 1, 3)));
  Value hn = chunk(c.b, hid, 2, 3);
  Value n = c.b.unary("tanh", add(c.b, chunk(c.b, in, 2, 3), mul(c.b, r, hn)));
  Value hy = add(c.b, n, mul(c.b, z, sub(c.b, hx, n)));
  return {hy, concat_last(c.b, {r, z, n, hx, hn})};
}
// (grad_hy, workspace, has_bias) -> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias?, grad_hidden_bias?)
std::vector<Value> lower_gru_cell_backward(Context& c) {
  ElementType e = widen(c.output(0).element);
  Value go = input(c, "grad_hy", e), ws = input(c, "workspace", e);
  Value r = chunk(c.b, ws, 0, 5), z = chunk(c.b, ws, 1, 5), n = chunk(c.b, ws, 2, 5), hx = chunk(c.b, ws, 3, 5),
        hn = chunk(c.b, ws, 4, 5);
  Value gz = mul(c.b, mul(c.b, go, sub(c.b, hx, n)), sigmoid_grad(c.b, z));
  Value gn = mul(c.b, mul(c.b, go, one_minus(c.b, z)), tanh_grad(c.b, n));
  Value gr = mul(c.b, mul(c.b, gn, hn), sigmoid_grad(c.b, r));
  Value grad_in = concat_last(c.b, {gr, gz, gn}), grad_hidden = concat_last(c.b, {gr, gz, mul(c.b, gn, r)});
  return {grad_in, grad_hidden, mul(c.b, go, z), bias_grad(c.b, grad_in), bias_grad(c.b, grad_hidden)};
}

}  // namespace

void register_nn(Table& t) {
  add_lowerings(t, {
           {"_softmax", lower_softmax}, {"_log_softmax", lower_log_softmax},
           {"_softmax_backward_data", lower_softmax_backward},
           {"_log_softmax_backward_data", lower_log_softmax_backward}, {"convolution", lower_convolution},
           {"convolution_backward", lower_convolution_backward}, {"max_pool2d_with_indices", lower_max_pool2d},
           {"max_pool3d_with_indices", lower_max_pool3d},
           {"max_pool2d_with_indices_backward", lower_max_pool2d_backward},
           {"max_pool3d_with_indices_backward", lower_max_pool3d_backward}, {"avg_pool2d", lower_avg_pool2d},
           {"avg_pool3d", lower_avg_pool3d}, {"avg_pool2d_backward", lower_avg_pool2d_backward},
           {"avg_pool3d_backward", lower_avg_pool3d_backward}, {"_adaptive_avg_pool2d", lower_adaptive_avg_pool},
           {"_adaptive_avg_pool3d", lower_adaptive_avg_pool},
           {"_adaptive_avg_pool2d_backward", lower_adaptive_avg_pool2d_backward},
           {"_adaptive_avg_pool3d_backward", lower_adaptive_avg_pool3d_backward},
           {"native_layer_norm", lower_layer_norm}, {"native_layer_norm_backward", lower_layer_norm_backward},
           {"native_batch_norm_backward", lower_batch_norm_backward}, {"native_group_norm", lower_group_norm},
           {"native_group_norm_backward", lower_group_norm_backward}, {"nll_loss_forward", lower_nll_loss},
           {"nll_loss2d_forward", lower_nll_loss}, {"nll_loss_backward", lower_nll_loss_backward},
           {"nll_loss2d_backward", lower_nll_loss_backward}, {"_thnn_fused_lstm_cell", lower_lstm_cell},
           {"_thnn_fused_lstm_cell_backward_impl", lower_lstm_cell_backward},
           {"_thnn_fused_gru_cell", lower_gru_cell}, {"_thnn_fused_gru_cell_backward", lower_gru_cell_backward}});
  add_lowering(t, "native_batch_norm", lower_batch_norm, false, {"running_mean", "running_var"}).cpu(kBatchNormStats);
  rule(t, "native_layer_norm").cpu(kLayerNormStats);
  // CPU kernels choose channels_last results where the meta kernels say row-major. The generic
  // convolution kernels route to a device hook that throws (convolution_overrideable): sent to the lowering.
  for (const char* name : {"convolution", "convolution_backward"}) rule(t, name).cpu(kConvLayout).route(Route::ToLowering);
  for (const char* name : {"max_pool2d_with_indices", "max_pool2d_with_indices_backward"}) rule(t, name).cpu(kPool2dLayout);
  for (const char* name : {"max_pool3d_with_indices", "max_pool3d_with_indices_backward"}) rule(t, name).cpu(kPool3dLayout);
  // Inference batch norm in torch.compile's graphs. (_native_batch_norm_legit stays on the CPU: its CPU kernel
  // returns saved stats in the input's dtype, and empty ones in eval mode, where its meta kernel says float32 [C].)
  add_lowering(t, "_native_batch_norm_legit_no_training", lower_batch_norm_no_training);
}

}  // namespace torch_pjrt::lowering
