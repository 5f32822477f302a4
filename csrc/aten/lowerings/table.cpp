// The op-name -> lowering table, filled once by the family files.
#include <algorithm>
#include <unordered_map>

#include "aten/lowering.h"
#include "pjrt/error.h"

namespace torch_pjrt::lowering {

struct Table {
  std::unordered_map<std::string, LoweringEntry> entries;
};

void add_lowering(Table& table, const std::string& name, LoweringFn fn, bool bake_scalars,
                  std::vector<std::string> extra_writes, std::vector<std::string> runtime_floats) {
  table.entries[name] = LoweringEntry{fn, bake_scalars, std::move(extra_writes), std::move(runtime_floats)};
}

namespace {
LoweringEntry& entry_named(Table& table, const std::string& name) {
  auto it = table.entries.find(name);
  PJRT_CHECK(it != table.entries.end(), "internal: no lowering named ", name);
  return it->second;
}
}  // namespace

void mark_elementwise(Table& table, const std::string& name) { entry_named(table, name).elementwise = true; }
void allow_runtime_length(Table& table, const std::string& name, double padding) {
  entry_named(table, name).length_padding = padding;
}
void allow_complex(Table& table, const std::string& name) { entry_named(table, name).complex = true; }

namespace {
const Table& table() {
  static const Table t = [] {
    Table t;
    register_pointwise(t);
    register_reduction(t);
    register_linalg(t);
    register_shape(t);
    register_indexing(t);
    register_nn(t);
    register_random(t);
    register_amp(t);
    register_optim(t);
    register_moe(t);
    register_attention(t);
    register_external(t);
    register_complex(t);
    return t;
  }();
  return t;
}
}  // namespace

const LoweringEntry* find_lowering(std::string_view base_name) {
  auto it = table().entries.find(std::string(base_name));
  return it == table().entries.end() ? nullptr : &it->second;
}

std::vector<std::string> lowered_op_names() {
  std::vector<std::string> names;
  for (const auto& [name, entry] : table().entries) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Dims broadcast_shape(const Dims& a, const Dims& b) {
  size_t rank = std::max(a.size(), b.size());
  Dims out(rank, 1);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    PJRT_CHECK(da == db || da == 1 || db == 1, "shapes cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Value broadcast_to(Builder& b, const Value& x, const Dims& dims) {
  if (x.dims() == dims) return x;
  // Drop size-1 dims that must stretch, then broadcast_in_dim the rest.
  size_t lead = dims.size() - x.dims().size();
  Dims kept_dims, mapping;
  for (size_t i = 0; i < x.dims().size(); ++i) {
    if (x.dims()[i] == dims[lead + i]) {
      kept_dims.push_back(x.dims()[i]);
      mapping.push_back(static_cast<int64_t>(lead + i));
    }
  }
  Value squeezed = b.reshape(x, kept_dims);
  return b.broadcast_in_dim(squeezed, dims, mapping);
}

Value to(Builder& b, const Value& x, ElementType element, const Dims& dims) {
  return broadcast_to(b, b.convert(x, element), dims);
}

Value gather_rows(Builder& b, const Value& flat, const Value& row_length, int64_t rows, int64_t width) {
  const Dims block{rows, width};
  const TensorType index{ElementType::S64, block};
  Value source = b.binary("add", b.binary("multiply", b.iota(index, 0), b.broadcast_in_dim(row_length, block, {})),
                          b.iota(index, 1));
  return b.gather(flat, b.reshape(source, {rows, width, 1}), Builder::GatherDims{{}, {0}, {}, {}, {0}, 2}, {1}, block);
}

Value pack_rows(Builder& b, const Value& block, const Value& row_length, int64_t count) {
  const int64_t rows = block.dims()[0], width = block.dims()[1];
  const TensorType index{ElementType::S64, {count}};
  Value i = b.iota(index, 0), n = b.broadcast_in_dim(row_length, {count}, {});
  // Element i is lane i % n of row i / n; rows past the last clamp (their lanes are unspecified).
  Value row = b.binary("minimum", b.binary("divide", i, n), b.constant_int(rows - 1, ElementType::S64, {count}));
  Value source = b.binary("add", b.binary("multiply", row, b.constant_int(width, ElementType::S64, {count})),
                          b.binary("remainder", i, n));
  return b.gather(b.reshape(block, {rows * width}), b.reshape(source, {count, 1}),
                  Builder::GatherDims{{}, {0}, {}, {}, {0}, 1}, {1}, {count});
}

int64_t wrap_dim(int64_t dim, int64_t rank) {
  int64_t r = std::max<int64_t>(rank, 1);
  return dim < 0 ? dim + r : dim;
}

Dims all_dims(int64_t rank) {
  Dims d;
  for (int64_t i = 0; i < rank; ++i) d.push_back(i);
  return d;
}

Value zeros_like(Builder& b, const Value& x) { return b.constant(0, x.element(), x.dims()); }
Value scalar_like(Builder& b, double v, const Value& x) { return b.constant(v, x.element(), x.dims()); }

Value check_status(Builder& b, const std::vector<RuntimeCheck>& checks) {
  // From the last check to the first, so the first failure wins: two scalar
  // selects per check.
  Value index = b.constant_int(-1, ElementType::S64), bad = b.constant_int(0, ElementType::S64), size = bad;
  for (size_t k = checks.size(); k-- > 0;) {
    Value failed = b.unary("not", checks[k].ok);
    index = b.select(failed, b.constant_int(static_cast<int64_t>(k), ElementType::S64), index);
    bad = b.select(failed, checks[k].bad, bad);
    if (checks[k].size) size = b.select(failed, *checks[k].size, size);
  }
  return b.concatenate({b.reshape(index, {1}), b.reshape(bad, {1}), b.reshape(size, {1})}, 0);
}

}  // namespace torch_pjrt::lowering
