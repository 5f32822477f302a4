// Attention over packed and paged sequences: `_flash_attention_forward` and
// `_flash_attention_backward`, which torch.nn.attention.varlen.varlen_attn
// (TorchTitan's varlen attention) calls and which have no CPU kernel.
//
// One portable form serves three layouts: packed tokens with cumulative
// sequence starts (T, H, D), a plain batch (B, S, H, D), and keys and values
// read through a block table from a pool of pages (P, page, H, D), with
// seqused_k giving each sequence's key count. Every query lane attends to the
// key lanes of its own sequence under the causal and sliding-window limits,
// aligned bottom-right as flash attention is (query i of a sequence with Lq
// queries and Lk keys sees key j when j <= i + Lk - Lq). The scores are one
// dense [queries, keys] product masked per lane, so shapes never depend on
// the sequence lengths: those are runtime operands. A row that sees no key
// gives zeros and a log-sum-exp of +inf, as the flash kernel does.
#include <cmath>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

using hlo::Compare;
using hlo::Reducer;
constexpr ElementType s64 = ElementType::S64, f32 = ElementType::F32;

// The lanes of one side (queries or keys), per group g (a batch row; one
// group for packed tokens): the sequence each lane belongs to (`seq`), its
// position in that sequence, and whether it holds a token at all.
struct Lanes {
  Value seq, pos, valid;  // [G, T]: s64, s64, pred
};

// Lanes of `count` packed tokens split by cumulative starts `cu` (s64[N+1]):
// lane t is in sequence b when cu[b] <= t < cu[b+1]; lanes past cu[N] are
// padding. Also each lane's sequence's length (cu[b+1] - cu[b]) and `per_seq`
// (s64[N], if given) read at the lane's sequence.
struct PackedLanes {
  Lanes lanes;
  Value length;                  // [1, T]
  std::optional<Value> gathered;  // [1, T]: per_seq[seq]
};

// per[seq[t]] for each lane t as [1, T] (0 where seq[t] names no sequence): seq is s64[T], per s64[N]. A
// one-hot sum, not a gather: N is small and lanes past the sequences need no index in range.
Value at_seq(Builder& b, Value seq, Value per) {
  const int64_t count = seq.dims()[0], n = per.dims()[0];
  const Dims grid{count, n};
  Value mine = b.compare(b.broadcast_in_dim(seq, grid, {0}), b.iota(TensorType{s64, grid}, 1), Compare::EQ);
  Value picked = b.select(mine, b.broadcast_in_dim(per, grid, {1}), b.constant_int(0, s64, grid));
  return b.reshape(b.reduce(picked, b.constant_int(0, s64), {1}, Reducer::Add), {1, count});
}

PackedLanes packed_lanes(Builder& b, Value cu, int64_t count, std::optional<Value> per_seq = std::nullopt) {
  const int64_t n = cu.dims()[0] - 1;
  Value starts = b.slice(cu, {0}, {n}, {1}), ends = b.slice(cu, {1}, {n + 1}, {1});
  const Dims grid{count, n};
  Value lane = b.iota(TensorType{s64, grid}, 0);
  Value ended = b.compare(b.broadcast_in_dim(ends, grid, {1}), lane, Compare::LE);
  Value seq = b.reduce(b.convert(ended, s64), b.constant_int(0, s64), {1}, Reducer::Add);  // [T]
  auto at_seq = [&](Value per) { return lowering::at_seq(b, seq, per); };
  Value start = at_seq(starts);
  PackedLanes out{Lanes{b.reshape(seq, {1, count}), {}, {}}, at_seq(b.binary("subtract", ends, starts)), std::nullopt};
  Value t = b.iota(TensorType{s64, {1, count}}, 1);
  out.lanes.pos = b.binary("subtract", t, start);
  out.lanes.valid = b.compare(out.lanes.seq, b.constant_int(n, s64, {1, count}), Compare::LT);
  if (per_seq) out.gathered = at_seq(*per_seq);
  return out;
}

// What forward and backward share: inputs as [G, T, heads, width] in f32,
// the mask [G, Tq, Tk] of (query, key) pairs that attend, and the scale.
struct Problem {
  Value q, k, v;          // [G, Tq, H, D], [G, Tk, Hkv, D], [G, Tk, Hkv, Dv]
  Value allowed;          // [G, Tq, Tk]
  int64_t groups, queries, keys, heads, kv_heads, group;
  double scale;
  bool packed;            // query was (T, H, D): results drop the group dim
};

Value as_s64(Builder& b, Value x) { return x.element() == s64 ? x : b.convert(x, s64); }

// Keys and values of sequence s are the pages block_table[s, :] laid end to end: read them into [1, N * L]
// lanes (L = pages per sequence * page size, k and v given as [P, page, Hkv, D] and replaced), a lane valid
// below its sequence's seqused_k.
Lanes read_paged(Context& c, Value& k, Value& v, int64_t n, Value used) {
  Builder& b = c.b;
  const Dims kd = k.dims();
  const Dims table = c.tensor_dims("block_table");
  const int64_t page = kd[1], width = table[1] * page, lanes = n * width;
  // Slot j of sequence s is on page block_table[s, j / page], at row j % page.
  Value pages = b.reshape(as_s64(b, c.tensor("block_table")), {n * table[1]});
  const Dims slot_dims{n, width};
  Value j = b.iota(TensorType{s64, slot_dims}, 1);
  Value entry = b.binary("add", b.binary("multiply", b.iota(TensorType{s64, slot_dims}, 0),
                                         b.constant_int(table[1], s64, slot_dims)),
                         b.binary("divide", j, b.constant_int(page, s64, slot_dims)));
  Value page_of = b.reshape(b.gather(pages, b.reshape(entry, {lanes}), hlo::Builder::GatherDims{{}, {0}, {}, {}, {0}, 1},
                                     {1}, {lanes}),
                            slot_dims);
  Value row = b.binary("add", b.binary("multiply", page_of, b.constant_int(page, s64, slot_dims)),
                       b.binary("remainder", j, b.constant_int(page, s64, slot_dims)));
  auto read = [&](Value pool) {
    const Dims pd = pool.dims();
    Value flat = b.reshape(pool, {pd[0] * pd[1], pd[2], pd[3]});
    Value rows = b.gather(flat, b.reshape(row, {lanes}), hlo::Builder::GatherDims{{1, 2}, {0}, {}, {}, {0}, 1},
                          {1, pd[2], pd[3]}, {lanes, pd[2], pd[3]});
    return b.reshape(rows, {1, lanes, pd[2], pd[3]});
  };
  k = read(k);
  v = read(v);
  Value lane = b.iota(TensorType{s64, {1, lanes}}, 1);
  Lanes kl;
  kl.seq = b.binary("divide", lane, b.constant_int(width, s64, {1, lanes}));
  kl.pos = b.binary("remainder", lane, b.constant_int(width, s64, {1, lanes}));
  kl.valid = b.compare(kl.pos, at_seq(b, b.reshape(kl.seq, {lanes}), used), Compare::LT);
  return kl;
}

Problem problem(Context& c, bool paged_allowed) {
  Builder& b = c.b;
  if (c.has("dropout_p") && c.float_arg("dropout_p") != 0.0) throw Unsupported("flash attention: dropout");
  if (c.has("alibi_slopes")) throw Unsupported("flash attention: alibi slopes");
  const Dims qd = c.tensor_dims("query");
  const bool packed = qd.size() == 3;
  if (!packed && qd.size() != 4) throw Unsupported("flash attention: query is not 3-d or 4-d");
  const bool paged = paged_allowed && c.has("block_table");
  if (packed && !(c.has("cum_seq_q") && c.tensor_dims("cum_seq_q").size() == 1))
    throw Unsupported("flash attention: packed query without cum_seq_q");
  if (!packed && (paged || c.has("seqused_k"))) throw Unsupported("flash attention: a batch with seqused_k");
  if (paged && !c.has("seqused_k")) throw Unsupported("flash attention: a block table without seqused_k");

  Problem p{};
  p.packed = packed;
  Value q = b.convert(c.tensor("query"), f32), k = b.convert(c.tensor("key"), f32), v = b.convert(c.tensor("value"), f32);
  if (packed) q = b.reshape(q, {1, qd[0], qd[1], qd[2]});
  Lanes ql, kl;
  Value offset;  // [G, Tq]: Lk - Lq of each query's sequence (bottom-right alignment)
  if (packed) {
    Value cu_q = as_s64(b, c.tensor("cum_seq_q"));
    const int64_t n = cu_q.dims()[0] - 1;
    std::optional<Value> used;
    if (c.has("seqused_k")) used = as_s64(b, c.tensor("seqused_k"));
    if (paged) {
      kl = read_paged(c, k, v, n, *used);
    } else {
      const Dims kd = k.dims();  // [Tk, Hkv, D]
      if (!c.has("cum_seq_k")) throw Unsupported("flash attention: packed keys without cum_seq_k");
      k = b.reshape(k, {1, kd[0], kd[1], kd[2]});
      const Dims vd = v.dims();
      v = b.reshape(v, {1, vd[0], vd[1], vd[2]});
      PackedLanes kp = packed_lanes(b, as_s64(b, c.tensor("cum_seq_k")), kd[0], used);
      kl = kp.lanes;
      if (used) kl.valid = b.binary("and", kl.valid, b.compare(kl.pos, *kp.gathered, Compare::LT));
    }
    // Each query's sequence's key count: seqused_k, or the cum_seq_k difference.
    Value per_seq_keys;
    if (used) {
      per_seq_keys = *used;
    } else {
      Value cu_k = as_s64(b, c.tensor("cum_seq_k"));
      per_seq_keys = b.binary("subtract", b.slice(cu_k, {1}, {n + 1}, {1}), b.slice(cu_k, {0}, {n}, {1}));
    }
    PackedLanes qp = packed_lanes(b, cu_q, qd[0], per_seq_keys);
    ql = qp.lanes;
    offset = b.binary("subtract", *qp.gathered, qp.length);  // each query's sequence's key count - its query count
  } else {
    const Dims kd = k.dims();
    const Dims qdims{qd[0], qd[1]}, kdims{kd[0], kd[1]};
    ql = Lanes{b.constant_int(0, s64, qdims), b.iota(TensorType{s64, qdims}, 1), b.constant_bool(true, qdims)};
    kl = Lanes{b.constant_int(0, s64, kdims), b.iota(TensorType{s64, kdims}, 1), b.constant_bool(true, kdims)};
    offset = b.constant_int(kd[1] - qd[1], s64, qdims);
  }

  p.q = q;
  p.k = k;
  p.v = v;
  p.groups = q.dims()[0];
  p.queries = q.dims()[1];
  p.heads = q.dims()[2];
  p.keys = k.dims()[1];
  p.kv_heads = k.dims()[2];
  if (p.kv_heads == 0 || p.heads % p.kv_heads != 0) throw Unsupported("flash attention: heads not a multiple of key heads");
  p.group = p.heads / p.kv_heads;
  p.scale = c.has("scale") ? c.float_arg("scale") : 1.0 / std::sqrt(static_cast<double>(q.dims()[3]));

  const Dims grid{p.groups, p.queries, p.keys};
  auto by_query = [&](Value x) { return b.broadcast_in_dim(x, grid, {0, 1}); };
  auto by_key = [&](Value x) { return b.broadcast_in_dim(x, grid, {0, 2}); };
  Value allowed = b.binary("and", b.compare(by_query(ql.seq), by_key(kl.seq), Compare::EQ),
                           b.binary("and", by_query(ql.valid), by_key(kl.valid)));
  // Key j is in query i's window when diagonal - left <= j <= diagonal + right, diagonal = i + Lk - Lq.
  Value diagonal = by_query(b.binary("add", ql.pos, offset)), j = by_key(kl.pos);
  int64_t left = c.has("window_size_left") ? c.int_arg("window_size_left") : -1;
  int64_t right = c.has("window_size_right") ? c.int_arg("window_size_right") : -1;
  if (c.bool_arg("is_causal")) right = 0;
  if (right >= 0)
    allowed = b.binary("and", allowed,
                       b.compare(j, b.binary("add", diagonal, b.constant_int(right, s64, grid)), Compare::LE));
  if (left >= 0)
    allowed = b.binary("and", allowed,
                       b.compare(j, b.binary("subtract", diagonal, b.constant_int(left, s64, grid)), Compare::GE));
  p.allowed = allowed;
  return p;
}

// Scaled scores [G, Hkv, group, Tq, Tk], -inf where not allowed.
Value scores(Builder& b, const Problem& p) {
  const int64_t width = p.q.dims()[3];
  Value q5 = b.reshape(p.q, {p.groups, p.queries, p.kv_heads, p.group, width});
  // batch (G, Hkv), then q's (Tq, group), then k's (Tk)
  Value s = b.dot_general(q5, p.k, {0, 2}, {0, 2}, {4}, {3}, f32);
  s = b.transpose(s, {0, 1, 3, 2, 4});
  const Dims sd{p.groups, p.kv_heads, p.group, p.queries, p.keys};
  s = b.binary("multiply", s, b.constant(p.scale, f32, sd));
  Value allowed = b.broadcast_in_dim(p.allowed, sd, {0, 3, 4});
  return b.select(allowed, s, b.constant(-INFINITY, f32, sd));
}

// probabilities exp(s - lse) [G, Hkv, group, Tq, Tk] from the log-sum-exp [G, Hkv, group, Tq] (+inf: no key).
Value probabilities(Builder& b, Value s, Value lse) {
  return b.unary("exponential", b.binary("subtract", s, b.broadcast_in_dim(lse, s.dims(), {0, 1, 2, 3})));
}

// [G, Tq, Hkv, group, X] -> the op's layout: (T, H, X) packed or (B, S, H, X).
Value query_layout(Builder& b, const Problem& p, Value x) {
  const int64_t last = x.dims().back();
  return p.packed ? b.reshape(x, {p.queries, p.heads, last}) : b.reshape(x, {p.groups, p.queries, p.heads, last});
}

// The attention output in the op's layout and `out_element`, and the log-sum-exp ((H, T) packed, (B, H, S) a batch).
std::pair<Value, Value> attend(Context& c, ElementType out_element) {
  Builder& b = c.b;
  Problem p = problem(c, true);
  Value s = scores(b, p);
  const Dims rows{p.groups, p.kv_heads, p.group, p.queries};
  Value row_max = b.reduce(s, b.constant(-INFINITY, f32), {4}, Reducer::Max);
  Value none = b.compare(row_max, b.constant(-INFINITY, f32, rows), Compare::EQ);
  Value shift = b.select(none, b.constant(0, f32, rows), row_max);
  Value total = b.reduce(b.unary("exponential", b.binary("subtract", s, b.broadcast_in_dim(shift, s.dims(), {0, 1, 2, 3}))),
                         b.constant(0, f32), {4}, Reducer::Add);
  Value lse = b.select(none, b.constant(INFINITY, f32, rows), b.binary("add", shift, b.unary("log", total)));
  Value probs = probabilities(b, s, lse);
  // batch (G, Hkv), then p's (group, Tq), then v's (Dv)
  Value out = b.dot_general(probs, p.v, {0, 1}, {0, 2}, {4}, {1}, f32);
  out = b.transpose(out, {0, 3, 1, 2, 4});  // [G, Tq, Hkv, group, Dv]
  out = b.convert(query_layout(b, p, out), out_element);
  Value lse_out = b.reshape(lse, {p.groups, p.heads, p.queries});
  if (p.packed) lse_out = b.reshape(lse_out, {p.heads, p.queries});
  return {out, lse_out};
}

std::vector<Value> lower_flash_forward(Context& c) {
  Builder& b = c.b;
  auto [out, lse_out] = attend(c, c.output(0).element);
  // rng_state, unused and the debug mask: no dropout, so fixed values of the meta kernel's shapes.
  std::vector<Value> results{out, lse_out};
  for (size_t i = 2; i < c.output_count(); ++i) {
    const OutputMeta& m = c.output(i);
    results.push_back(b.constant_int(0, m.element, m.dims));  // constant_int makes floats too
  }
  return results;
}

std::vector<Value> lower_flash_backward(Context& c) {
  Builder& b = c.b;
  Problem p = problem(c, false);
  Value s = scores(b, p);
  const Dims rows{p.groups, p.kv_heads, p.group, p.queries};
  Value lse = b.reshape(b.convert(c.tensor("logsumexp"), f32), rows);
  Value probs = probabilities(b, s, lse);
  const int64_t value_width = p.v.dims()[3], width = p.q.dims()[3];
  auto grouped = [&](std::string_view name, int64_t last) {  // [G, Tq, Hkv, group, last]
    return b.reshape(b.convert(c.tensor(name), f32), {p.groups, p.queries, p.kv_heads, p.group, last});
  };
  Value d_out = grouped("grad_out", value_width), out = grouped("out", value_width);
  // dV = P^T dO, summed over the query heads sharing a key head
  Value dv = b.dot_general(probs, d_out, {0, 1}, {0, 2}, {2, 3}, {3, 1}, f32);  // [G, Hkv, Tk, Dv]
  dv = b.transpose(dv, {0, 2, 1, 3});
  // dS = P * (dO V^T - rowsum(dO * O))
  Value dp = b.transpose(b.dot_general(d_out, p.v, {0, 2}, {0, 2}, {4}, {3}, f32), {0, 1, 3, 2, 4});
  Value delta = b.reduce(b.binary("multiply", d_out, out), b.constant(0, f32), {4}, Reducer::Add);  // [G, Tq, Hkv, group]
  delta = b.transpose(delta, {0, 2, 3, 1});
  Value ds = b.binary("multiply", probs, b.binary("subtract", dp, b.broadcast_in_dim(delta, dp.dims(), {0, 1, 2, 3})));
  ds = b.binary("multiply", ds, b.constant(p.scale, f32, ds.dims()));
  Value dq = b.transpose(b.dot_general(ds, p.k, {0, 1}, {0, 2}, {4}, {1}, f32), {0, 3, 1, 2, 4});  // [G, Tq, Hkv, group, D]
  Value q5 = b.reshape(p.q, {p.groups, p.queries, p.kv_heads, p.group, width});
  Value dk = b.transpose(b.dot_general(ds, q5, {0, 1}, {0, 2}, {2, 3}, {3, 1}, f32), {0, 2, 1, 3});  // [G, Tk, Hkv, D]
  auto key_layout = [&](Value x) { return p.packed ? b.reshape(x, {p.keys, p.kv_heads, x.dims()[3]}) : x; };
  return {b.convert(query_layout(b, p, dq), c.output(0).element), b.convert(key_layout(dk), c.output(1).element),
          b.convert(key_layout(dv), c.output(2).element)};
}

}  // namespace

void register_packed_attention(Table& t) {
  add_lowering(t, "_flash_attention_forward", lower_flash_forward);
  add_lowering(t, "_flash_attention_backward", lower_flash_backward);
  // varlen_attn_out: the log-sum-exp is the return, `out` the written argument (after the returns).
  add_lowering(t, "_flash_attention_forward_no_dropout_inplace", [](Context& c) {
    auto [out, lse] = attend(c, c.output(1).element);
    return std::vector<Value>{lse, out};
  });
}

}  // namespace torch_pjrt::lowering
