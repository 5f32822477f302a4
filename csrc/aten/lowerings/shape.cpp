// Ops that move data without arithmetic: cat, flip, roll, tril/triu, sort and
// topk. Metadata-only views (view, permute, expand, slice, ...) never get here:
// they are as_strided over the same storage (registrations.cpp).
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// Each piece's data written at its position into zeros, in order: a piece's
// tail past its own length is overwritten by the pieces after it or lies past
// the result's size. The slack keeps every update in bounds (XLA would clamp
// its start and shift it).
Value flat_cat(Builder& b, const std::vector<Context::FlatPiece>& pieces, int64_t capacity) {
  int64_t slack = 0;
  for (const auto& p : pieces) slack = std::max(slack, p.data.dims()[0]);
  ElementType e = pieces.at(0).data.element();
  Value out = b.constant(0, e, {capacity + slack});
  for (const auto& p : pieces)
    out = b.dynamic_update_slice(out, p.data, {p.position ? *p.position : b.constant_int(0, ElementType::S64)});
  return b.slice(out, {0}, {capacity}, {1});
}

// A flat cat of `rows` rows (a batch of sequences, each growing by a column):
// row b of the result is row b of every piece in turn, and every length comes
// at runtime. Each piece's rows are gathered from its flat storage into a
// [rows, bound] block (bound: the most a row of it can hold); the elements
// past its row length go to a sink slot past the capacity, cut off at the end.
Value row_cat(Builder& b, const std::vector<Context::FlatPiece>& pieces, int64_t capacity, int64_t rows) {
  const ElementType s64 = ElementType::S64;
  std::vector<Value> row_length;
  for (const auto& p : pieces) row_length.push_back(b.binary("divide", *p.length, b.constant_int(rows, s64)));
  Value total = row_length[0];
  for (size_t k = 1; k < row_length.size(); ++k) total = b.binary("add", total, row_length[k]);
  Value out = b.constant(0, pieces.at(0).data.element(), {capacity + 1});
  Value start = b.constant_int(0, s64);
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Dims block{rows, std::max<int64_t>(pieces[k].data.dims()[0] / rows, 1)};
    Value row = b.iota(TensorType{s64, block}, 0), column = b.iota(TensorType{s64, block}, 1);
    auto spread = [&](const Value& scalar) { return b.broadcast_in_dim(scalar, block, {}); };
    Value target = b.binary("add", b.binary("add", b.binary("multiply", row, spread(total)), spread(start)), column);
    target = b.select(b.compare(column, spread(row_length[k]), hlo::Compare::LT), target,
                      b.constant_int(capacity, s64, block));
    Value values = gather_rows(b, pieces[k].data, row_length[k], rows, block[1]);
    out = b.scatter(out, b.reshape(target, {rows, block[1], 1}), values, Builder::ScatterDims{{}, {0}, {}, {}, {0}, 2},
                    /*combine=*/std::nullopt);
    start = b.binary("add", start, row_length[k]);
  }
  return b.slice(out, {0}, {capacity}, {1});
}

// F.pad(x, pad, value="constant"): pairs (low, high) from the last dim back;
// negative amounts cut. One op instead of PyTorch's composite (empty, fill_,
// a copy into a narrowed view), whose view shapes would hold the sizes.
// A capacity input padded on its last dim only to a fixed width (generation
// pads its growing attention mask to the static cache's length) is read
// padded (Context::padded) and masked past its true length, so the program
// does not depend on that length.
std::vector<Value> lower_constant_pad_nd(Context& c) {
  const OutputMeta& o = c.output(0);
  const Dims pad = c.int_list("pad");
  const int64_t rank = static_cast<int64_t>(c.tensor_dims("self").size());
  if (pad.size() % 2 != 0 || static_cast<int64_t>(pad.size()) > 2 * rank)
    throw Unsupported("constant_pad_nd: pad of odd length or more dims than the tensor");
  Value value = c.scalar("value", o.element);  // as fill_ takes it: the CPU's range check, one rounding
  if (rank > 0 && pad.size() == 2 && pad[0] == 0 && pad[1] >= 0) {
    if (auto p = c.padded("self", rank - 1)) {
      Value x = p->value;
      const int64_t bound = x.dims().back(), width = o.dims.back();
      Dims zeros(rank, 0), high(rank, 0);
      high.back() = width - bound;  // negative: cut the block to the width
      x = c.b.pad(x, value, zeros, high, zeros);
      Value lane = c.b.iota(TensorType{ElementType::S64, o.dims}, rank - 1);
      Value inside = c.b.compare(lane, c.b.broadcast_in_dim(p->size, o.dims, {}), hlo::Compare::LT);
      return {c.b.select(inside, x, c.b.broadcast_in_dim(value, o.dims, {}))};
    }
  }
  Dims low(rank, 0), high(rank, 0);
  for (size_t k = 0; k < pad.size() / 2; ++k) {
    low[rank - 1 - k] = pad[2 * k];
    high[rank - 1 - k] = pad[2 * k + 1];
  }
  return {c.b.pad(c.tensor("self"), value, low, high, Dims(rank, 0))};
}

std::vector<Value> lower_cat(Context& c) {
  if (int64_t capacity = c.flat_capacity()) {
    int64_t rows = c.flat_rows();
    return {rows > 1 ? row_cat(c.b, c.flat_pieces("tensors"), capacity, rows)
                     : flat_cat(c.b, c.flat_pieces("tensors"), capacity)};
  }
  const OutputMeta& o = c.output(0);
  int64_t rank = static_cast<int64_t>(o.dims.size());
  int64_t dim = wrap_dim(c.int_arg("dim"), rank);
  std::vector<Value> parts;
  for (const auto& t : c.tensor_list("tensors")) {
    // PyTorch skips legacy empty 1-D tensors of any other rank.
    if (!t || t->type.element_count() == 0) continue;
    parts.push_back(c.b.convert(*t, o.element));
  }
  if (parts.empty()) return {c.b.constant(0, o.element, o.dims)};
  return {parts.size() == 1 ? parts[0] : c.b.concatenate(parts, dim)};
}

std::vector<Value> lower_flip(Context& c) {
  Value x = c.tensor("self");
  Dims dims = c.int_list("dims");  // empty: nothing flips
  for (auto& d : dims) d = wrap_dim(d, x.rank());
  if (dims.empty() || x.rank() == 0) return {x};
  return {c.b.reverse(x, dims)};
}

// roll by `shift` along one dim: two slices swapped.
Value roll_one(Builder& b, Value x, int64_t dim, int64_t shift) {
  int64_t n = x.dims()[dim];
  if (n == 0) return x;
  shift = ((shift % n) + n) % n;
  if (shift == 0) return x;
  Dims start(x.rank(), 0), limit = x.dims(), strides(x.rank(), 1);
  limit[dim] = n - shift;
  Value head = b.slice(x, start, limit, strides);
  start[dim] = n - shift;
  limit[dim] = n;
  Value tail = b.slice(x, start, limit, strides);
  return b.concatenate({tail, head}, dim);
}
std::vector<Value> lower_roll(Context& c) {
  Value x = c.tensor("self");
  Dims shifts = c.int_list("shifts");
  Dims dims = c.has("dims") ? c.int_list("dims") : Dims{};
  if (dims.empty()) {  // roll the flattened tensor
    Value flat = c.b.reshape(x, {x.type.element_count()});
    return {c.b.reshape(roll_one(c.b, flat, 0, shifts.at(0)), x.dims())};
  }
  for (size_t i = 0; i < dims.size(); ++i) x = roll_one(c.b, x, wrap_dim(dims[i], x.rank()), shifts.at(i));
  return {x};
}

// Keeps elements with (col - row) <= diagonal (tril) or >= diagonal (triu).
std::vector<Value> triangle(Context& c, bool lower) {
  Value x = c.tensor("self");
  int64_t r = x.rank();
  Value row = c.b.iota(TensorType{ElementType::S64, x.dims()}, r - 2);
  Value col = c.b.iota(TensorType{ElementType::S64, x.dims()}, r - 1);
  int64_t diagonal = c.has("diagonal") ? c.int_arg("diagonal") : 0;
  Value offset = c.b.binary("subtract", col, row);
  Value keep = c.b.compare(offset, c.b.constant_int(diagonal, ElementType::S64, x.dims()),
                           lower ? hlo::Compare::LE : hlo::Compare::GE);
  return {c.b.select(keep, x, zeros_like(c.b, x))};
}
std::vector<Value> lower_tril(Context& c) { return triangle(c, true); }
std::vector<Value> lower_triu(Context& c) { return triangle(c, false); }

// sort(self, stable, dim, descending) -> (values, indices)
std::vector<Value> lower_sort(Context& c) {
  Value x = c.tensor("self");
  if (x.rank() == 0) return {x, c.b.constant_int(0, ElementType::S64)};
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  Value idx = c.b.iota(TensorType{ElementType::S64, x.dims()}, dim);
  return c.b.sort({x, idx}, dim, c.bool_arg("descending"));
}

std::vector<Value> lower_topk(Context& c) {
  Value x = c.tensor("self");
  int64_t k = c.int_arg("k");
  int64_t dim = wrap_dim(c.int_arg("dim"), x.rank());
  if (x.rank() == 0) return {x, c.b.constant_int(0, ElementType::S64)};
  Value idx = c.b.iota(TensorType{ElementType::S64, x.dims()}, dim);
  auto sorted = c.b.sort({x, idx}, dim, c.bool_arg("largest"));
  Dims start(x.rank(), 0), limit = x.dims(), strides(x.rank(), 1);
  limit[dim] = k;
  return {c.b.slice(sorted[0], start, limit, strides), c.b.slice(sorted[1], start, limit, strides)};
}

// ---- factories (their out= forms: `torch.arange(..., device="tpu")` ends here) ----

// start + i * step, computed in f64 (or s64 for integer outputs) as PyTorch's
// CPU kernel accumulates; the bounds are baked: they decide the length. An
// integer start is a runtime operand: a runtime-length arange
// (growth.cpp, runtime_length_of) keys neither it nor its end.
std::vector<Value> lower_arange(Context& c) {
  const OutputMeta& o = c.output(0);
  bool integral = !is_float(o.element);
  ElementType e = integral ? ElementType::S64 : ElementType::F64;
  double step = c.has("step") ? c.scalar_value("step") : 1;
  Value start = c.b.constant(0, e, o.dims);
  if (c.has("start") && integral && c.scalar_kind("start") == ElementType::S64)
    start = c.b.broadcast_in_dim(c.scalar("start", e), o.dims, {});
  else if (c.has("start"))
    start = c.b.constant(c.scalar_value("start"), e, o.dims);
  Value i = c.b.iota(TensorType{e, o.dims}, 0);
  return {c.b.binary("add", c.b.binary("multiply", i, c.b.constant(step, e, o.dims)), start)};
}

// Symmetric like PyTorch's: the first half counts up from start, the second
// half down from end, so both ends are exact.
std::vector<Value> lower_linspace(Context& c) {
  const OutputMeta& o = c.output(0);
  int64_t steps = c.int_arg("steps");
  ElementType e = is_float(o.element) && o.element != ElementType::F64 ? ElementType::F32 : ElementType::F64;
  Value start = operand(c, "start", e, o.dims);  // a Scalar, or a 0-d tensor in the Tensor overloads
  if (steps <= 1) return {start};
  Value end = operand(c, "end", e, o.dims);
  Value step = c.b.binary("divide", c.b.binary("subtract", end, start), c.b.constant(static_cast<double>(steps - 1), e, o.dims));
  Value i = c.b.iota(TensorType{e, o.dims}, 0);
  Value up = c.b.binary("add", start, c.b.binary("multiply", i, step));
  Value back = c.b.binary("subtract", c.b.constant(static_cast<double>(steps - 1), e, o.dims), i);
  Value down = c.b.binary("subtract", end, c.b.binary("multiply", back, step));
  Value first_half = c.b.compare(i, c.b.constant(static_cast<double>(steps / 2), e, o.dims), hlo::Compare::LT);
  return {c.b.select(first_half, up, down)};
}

std::vector<Value> lower_eye(Context& c) {
  const OutputMeta& o = c.output(0);
  Value row = c.b.iota(TensorType{ElementType::S64, o.dims}, 0), col = c.b.iota(TensorType{ElementType::S64, o.dims}, 1);
  return {c.b.compare(row, col, hlo::Compare::EQ)};
}

}  // namespace

void register_shape(Table& t) {
  // The 1-d factories' CPU kernels fill an out= of the right element count in its own shape.
  add_lowering(t, "arange", lower_arange, /*bake_scalars=*/true).cpu(kKeepsOutShape);
  add_lowering(t, "linspace", lower_linspace).cpu(kKeepsOutShape);
  for (const char* name : {"range", "logspace"}) rule(t, name).cpu(kKeepsOutShape);
  add_lowering(t, "eye", lower_eye);
  add_lowerings(t, {
           {"cat", lower_cat, kComplex}, {"constant_pad_nd", lower_constant_pad_nd, kComplex}, {"flip", lower_flip, kComplex}, {"roll", lower_roll, kComplex},
           {"tril", lower_tril, kComplex}, {"triu", lower_triu, kComplex}, {"sort", lower_sort}, {"topk", lower_topk}});
  rule(t, "cat").no_aliasing();  // an out= the very tensor it reads would be read while written
}

}  // namespace torch_pjrt::lowering
