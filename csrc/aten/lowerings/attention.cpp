// Attention: `_scaled_dot_product_fused_attention_overrideable`, the fused
// form scaled_dot_product_attention takes on tpu for inference (sdp_choice.cpp).
// softmax(q k^T * scale + mask) v, with grouped-query heads, a boolean or
// additive mask, top-left causal masking, and rows masked everywhere giving
// zeros (PyTorch's math path and CPU kernel). Math runs in f32 for f16/bf16.
//
// A key and value grown by row cats (a decoding KV cache) are read padded to
// their storage's capacity with the true length masked at runtime
// (Context::padded), so a step's program does not change as the cache grows.
#include <cmath>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

using hlo::Compare;
using hlo::Reducer;

std::vector<Value> lower_attention(Context& c) {
  Builder& b = c.b;
  const ElementType e = widen(c.output(0).element), s64 = ElementType::S64;
  const Dims key_dims = c.tensor_dims("key"), query_dims = c.tensor_dims("query");
  // sdp_choice.cpp sends only these here; a direct call outside them runs on the CPU (which has no kernel: an error).
  if (query_dims.size() != 4 || key_dims.size() != 4 || c.tensor_dims("value").size() != 4)
    throw Unsupported("attention: inputs are not 4-d");
  if (c.float_arg("dropout_p") != 0.0) throw Unsupported("attention: dropout");
  if (key_dims[1] == 0 || query_dims[1] % key_dims[1] != 0) throw Unsupported("attention: heads not a multiple of key heads");
  if (c.bool_arg("is_causal") && c.has("attn_bias")) throw Unsupported("attention: is_causal with a mask");
  Value q = b.convert(c.tensor("query"), e), k, v;
  std::optional<Value> length;  // the true key length when key and value are read padded
  auto padded_key = c.padded("key", 2), padded_value = c.padded("value", 2);
  if (padded_key && padded_value) {
    const int64_t bound = std::min(padded_key->value.dims()[2], padded_value->value.dims()[2]);
    auto cut = [&](const Value& x) {
      Dims limit = x.dims();
      limit[2] = bound;
      return b.slice(x, {0, 0, 0, 0}, limit, {1, 1, 1, 1});
    };
    k = cut(padded_key->value);
    v = cut(padded_value->value);
    length = padded_key->size;
  } else {
    k = c.tensor("key");
    v = c.tensor("value");
  }
  k = b.convert(k, e);
  v = b.convert(v, e);
  const int64_t batch = q.dims()[0], heads = q.dims()[1], queries = q.dims()[2], width = q.dims()[3];
  const int64_t kv_heads = k.dims()[1], keys = k.dims()[2], value_width = v.dims()[3];
  const int64_t group = heads / kv_heads;  // query heads per key head (grouped-query attention)
  const double scale = c.has("scale") ? c.float_arg("scale") : 1.0 / std::sqrt(static_cast<double>(width));

  // Scores [batch, heads, queries, keys]: query head h reads key head h / group.
  Value grouped_q = b.reshape(q, {batch, kv_heads, group, queries, width});
  Value scores = b.dot_general(grouped_q, k, {0, 1}, {0, 1}, {4}, {3}, e);
  const Dims score_dims{batch, heads, queries, keys};
  scores = b.binary("multiply", b.reshape(scores, score_dims), b.constant(scale, e, score_dims));

  const TensorType lanes{s64, score_dims};
  std::optional<Value> allowed;
  auto allow = [&](Value pred) { allowed = allowed ? b.binary("and", *allowed, pred) : pred; };
  if (c.has("attn_bias")) {
    // With a padded cache, a mask built per token (a left-padded batch's) may itself be read padded
    // (a runtime-length op's result); either way its lanes past the true length are masked below.
    std::optional<Context::Padded> padded_bias;
    const Dims bias_dims = c.tensor_dims("attn_bias");
    if (length && !bias_dims.empty() && bias_dims.back() != 1) padded_bias = c.padded("attn_bias", -1);
    Value bias = padded_bias ? padded_bias->value : c.tensor("attn_bias");
    if (length && bias.rank() > 0 && bias.dims().back() != 1 && bias.dims().back() != keys) {  // fit to the padded keys
      const int64_t have = bias.dims().back();
      if (have > keys) {
        Dims limit = bias.dims();
        limit.back() = keys;
        bias = b.slice(bias, Dims(bias.rank(), 0), limit, Dims(bias.rank(), 1));
      } else {
        Dims high(bias.rank(), 0);
        high.back() = keys - have;
        Value fill = bias.element() == ElementType::Pred ? b.constant_bool(false) : b.constant(0, bias.element());
        bias = b.pad(bias, fill, Dims(bias.rank(), 0), high, Dims(bias.rank(), 0));
      }
    }
    bias = broadcast_to(b, bias, score_dims);
    if (bias.element() == ElementType::Pred) allow(bias);
    else scores = b.binary("add", scores, b.convert(bias, e));
  }
  if (c.bool_arg("is_causal")) allow(b.compare(b.iota(lanes, 3), b.iota(lanes, 2), Compare::LE));  // top-left
  std::optional<Value> in_range;
  if (length) {
    in_range = b.compare(b.iota(lanes, 3), b.broadcast_in_dim(*length, score_dims, {}), Compare::LT);
    allow(*in_range);
  }
  if (allowed) scores = b.select(*allowed, scores, b.constant(-INFINITY, e, score_dims));

  // A softmax whose rows masked everywhere are zeros, not NaN.
  const Dims row_dims{batch, heads, queries};
  Value row_max = b.reduce(scores, b.constant(-INFINITY, e), {3}, Reducer::Max);
  Value none = b.compare(row_max, b.constant(-INFINITY, e, row_dims), Compare::EQ);
  Value shift = b.select(none, b.constant(0, e, row_dims), row_max);
  Value p = b.unary("exponential", b.binary("subtract", scores, b.broadcast_in_dim(shift, score_dims, {0, 1, 2})));
  Value total = b.reduce(p, b.constant(0, e), {3}, Reducer::Add);
  Value divisor = b.select(none, b.constant(1, e, row_dims), total);
  p = b.binary("divide", p, b.broadcast_in_dim(divisor, score_dims, {0, 1, 2}));

  // Padded value lanes may hold anything (another row's keys): zero them, since 0 * inf is NaN.
  if (length) {
    const Dims value_dims = v.dims();
    Value lane = b.iota(TensorType{s64, value_dims}, 2);
    v = b.select(b.compare(lane, b.broadcast_in_dim(*length, value_dims, {}), Compare::LT), v,
                 b.constant(0, e, value_dims));
  }
  Value grouped_p = b.reshape(p, {batch, kv_heads, group, queries, keys});
  Value out = b.reshape(b.dot_general(grouped_p, v, {0, 1}, {0, 1}, {4}, {2}, e), {batch, heads, queries, value_width});
  Value logsumexp = b.binary("add", row_max, b.unary("log", total));

  const Value unused = b.constant(0, ElementType::F32);  // absent returns (cum_seq_q/k, debug_attn_mask)
  const Value no_rng = b.constant_int(0, s64);          // philox seed and offset: no dropout
  return {out, b.convert(logsumexp, ElementType::F32), unused, unused, no_rng, no_rng, unused};
}

}  // namespace

void register_attention(Table& t) { add_lowering(t, "_scaled_dot_product_fused_attention_overrideable", lower_attention); }

}  // namespace torch_pjrt::lowering
