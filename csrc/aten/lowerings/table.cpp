// The op-name -> lowering table, filled once by the family files.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "aten/lowering.h"
#include "pjrt/error.h"

namespace torch_pjrt::lowering {

// Rules are never freed: a plan or a recorded graph keeps a pointer to the
// rule it was made with, which stays valid when Python replaces the rule.
struct Table {
  std::unordered_map<std::string, OpRule*> entries;  // "add", "mode.values", "sum@cpu"
};

namespace {
std::string rule_key(std::string_view name, std::string_view platform) {
  std::string key(name);
  if (!platform.empty()) key.append("@").append(platform);
  return key;
}
}  // namespace

RuleRef rule(Table& table, const std::string& name, const std::string& platform) {
  OpRule*& r = table.entries[rule_key(name, platform)];
  if (!r) {
    r = new OpRule();
    r->platform = platform;
  }
  return RuleRef(*r);
}

RuleRef add_lowering(Table& table, const std::string& name, LoweringFn fn, bool bake_scalars,
                     std::vector<std::string> extra_writes, std::vector<std::string> runtime_floats) {
  RuleRef ref = rule(table, name);
  OpRule& r = ref.rule();
  r.fn = fn;
  r.bake_scalars = bake_scalars;
  r.extra_writes = std::move(extra_writes);
  r.runtime_floats = std::move(runtime_floats);
  return ref;
}

void add_lowerings(Table& table, std::initializer_list<Registration> list, const std::string& platform) {
  for (const Registration& reg : list) {
    OpRule& r = rule(table, reg.name, platform).rule();
    r.fn = reg.fn;
    r.complex = r.complex || (reg.traits & kComplex);
    r.elementwise = r.elementwise || (reg.traits & kElementwise);
  }
}

namespace {
std::mutex g_rules_mutex;  // guards the table against register_rule
std::atomic<uint64_t> g_rules_epoch{1};
std::string g_platform;

Table& table() {
  static Table& t = *[] {
    auto* t = new Table();  // never destroyed: see Table
    register_pointwise(*t);
    register_reduction(*t);
    register_linalg(*t);
    register_shape(*t);
    register_indexing(*t);
    register_nn(*t);
    register_random(*t);
    register_amp(*t);
    register_optim(*t);
    register_moe(*t);
    register_attention(*t);
    register_packed_attention(*t);
    register_external(*t);
    register_complex(*t);
    return t;
  }();
  return t;
}

const OpRule* lookup(const Table& t, std::string_view name, std::string_view platform) {
  if (!platform.empty()) {
    auto it = t.entries.find(rule_key(name, platform));
    if (it != t.entries.end()) return it->second;
  }
  auto it = t.entries.find(std::string(name));
  return it == t.entries.end() ? nullptr : it->second;
}
}  // namespace

const OpRule* find_rule(std::string_view base_name, std::string_view overload, std::string_view platform) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(g_rules_mutex);
  if (!overload.empty()) {
    std::string named = std::string(base_name) + "." + std::string(overload);
    if (const OpRule* r = lookup(t, named, platform)) return r;
  }
  return lookup(t, base_name, platform);
}

std::vector<std::string> lowered_op_names() {
  std::vector<std::string> names;
  Table& t = table();
  std::lock_guard<std::mutex> lock(g_rules_mutex);
  for (const auto& [name, r] : t.entries)
    if (r->fn && r->platform.empty()) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> rule_names(const std::string& platform) {
  std::vector<std::string> names;
  Table& t = table();
  std::lock_guard<std::mutex> lock(g_rules_mutex);
  for (const auto& [name, r] : t.entries)
    if (r->platform == platform) names.push_back(platform.empty() ? name : name.substr(0, name.rfind('@')));
  std::sort(names.begin(), names.end());
  return names;
}

void register_rule(const std::string& name, OpRule r) {
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(g_rules_mutex);
    std::string key = rule_key(name, r.platform);
    t.entries[key] = new OpRule(std::move(r));  // the old record stays alive (see Table)
  }
  g_rules_epoch.fetch_add(1, std::memory_order_release);
}

std::string base_name_of(std::string_view name) {
  if (name.substr(0, 6) == "aten::") name.remove_prefix(6);
  if (size_t dot = name.find('.'); dot != std::string_view::npos) name = name.substr(0, dot);
  // add_ is add's in-place form; __iand__ is a name of its own.
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_') name.remove_suffix(1);
  return std::string(name);
}

std::string overload_of(std::string_view name) {
  size_t dot = name.find('.');
  return dot == std::string_view::npos ? std::string() : std::string(name.substr(dot + 1));
}

void set_platform(const std::string& platform) {
  {
    std::lock_guard<std::mutex> lock(g_rules_mutex);
    if (g_platform == platform) return;
    g_platform = platform;
  }
  g_rules_epoch.fetch_add(1, std::memory_order_release);
}
const std::string& current_platform() { return g_platform; }
uint64_t rules_epoch() { return g_rules_epoch.load(std::memory_order_acquire); }

const std::string& Context::platform() const { return current_platform(); }

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

Value check_status(Builder& b, const std::vector<RuntimeCheck>& checks, const std::optional<Value>& earlier_ok) {
  // From the last check to the first, so the first failure wins: two scalar
  // selects per check. The chain goes last: an own failure is reported first.
  Value index = b.constant_int(-1, ElementType::S64), bad = b.constant_int(0, ElementType::S64), size = bad;
  if (earlier_ok) index = b.select(*earlier_ok, index, b.constant_int(kEarlierCheckFailed, ElementType::S64));
  for (size_t k = checks.size(); k-- > 0;) {
    Value failed = b.unary("not", checks[k].ok);
    index = b.select(failed, b.constant_int(static_cast<int64_t>(k), ElementType::S64), index);
    bad = b.select(failed, checks[k].bad, bad);
    if (checks[k].size) size = b.select(failed, *checks[k].size, size);
  }
  return b.concatenate({b.reshape(index, {1}), b.reshape(bad, {1}), b.reshape(size, {1})}, 0);
}

}  // namespace torch_pjrt::lowering
