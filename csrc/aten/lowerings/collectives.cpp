#include "aten/lowerings/collectives.h"

#include <set>
#include <stdexcept>

namespace torch_pjrt::lowering {
namespace {

using hlo::Builder;
using hlo::Dims;
using hlo::TensorType;
using hlo::Value;

int64_t count_of(const Dims& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string dims_text(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Every replica in exactly one group, groups of one size (as StableHLO requires).
Builder::ReplicaGroups checked_groups(const CollectiveSpec& spec) {
  if (spec.groups.empty()) {
    Dims all;
    for (int64_t r = 0; r < spec.replicas; ++r) all.push_back(r);
    return {all};
  }
  std::set<int64_t> seen;
  for (const Dims& g : spec.groups) {
    if (g.empty() || g.size() != spec.groups[0].size())
      throw std::invalid_argument("replica groups must all have the same, nonzero size");
    for (int64_t r : g) {
      if (r < 0 || r >= spec.replicas || !seen.insert(r).second)
        throw std::invalid_argument("replica groups must name every replica 0.." + std::to_string(spec.replicas - 1) +
                                    " exactly once (replica " + std::to_string(r) + ")");
    }
  }
  if (static_cast<int64_t>(seen.size()) != spec.replicas)
    throw std::invalid_argument("replica groups must name every replica exactly once");
  return spec.groups;
}

hlo::Reducer reducer_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Avg: return hlo::Reducer::Add;
    case ReduceOp::Prod: return hlo::Reducer::Mul;
    case ReduceOp::Max: return hlo::Reducer::Max;
    case ReduceOp::Min: return hlo::Reducer::Min;
  }
  return hlo::Reducer::Add;
}

void check_reduce_op(ReduceOp op, ElementType element) {
  if (op == ReduceOp::Avg && !is_float(element) && !is_complex(element))
    throw std::invalid_argument(std::string("ReduceOp.AVG needs a floating point or complex tensor, got ") +
                                std::string(mlir_name(element)) + ": use SUM and divide");
  if ((op == ReduceOp::Max || op == ReduceOp::Min) && is_complex(element))
    throw std::invalid_argument("ReduceOp.MAX and MIN are not defined for complex tensors");
}

// Reduces across replicas, f16/bf16 accumulating in f32 with one rounding at the end
// (a sum of N halves rounded once, not N - 1 times); avg divides the sum by the group size.
Value reduce_across(Builder& b, Value x, const CollectiveSpec& spec, const Builder::ReplicaGroups& groups,
                    bool scatter, int64_t dim) {
  check_reduce_op(spec.op, spec.element);
  const ElementType element = x.element();
  const bool widen = element == ElementType::F16 || element == ElementType::BF16;
  if (widen) x = b.convert(x, ElementType::F32);
  hlo::Reducer reducer = reducer_of(spec.op);
  Value r = scatter ? b.reduce_scatter(x, dim, reducer, groups) : b.all_reduce(x, reducer, groups);
  if (spec.op == ReduceOp::Avg) {
    Value n = b.constant(static_cast<double>(groups[0].size()), r.element(), r.dims());
    r = b.binary("divide", r, n);
  }
  return widen ? b.convert(r, element) : r;
}

void check_divisible(const CollectiveSpec& spec, const Value& x, int64_t group) {
  if (spec.dim < 0 || spec.dim >= x.rank())
    throw std::invalid_argument(std::string(collective_name(spec.kind)) + ": dim " + std::to_string(spec.dim) +
                                " is out of range for shape " + dims_text(x.dims()));
  if (spec.kind != Collective::AllGather && x.dims()[spec.dim] % group != 0)
    throw std::invalid_argument(std::string(collective_name(spec.kind)) + ": dim " + std::to_string(spec.dim) +
                                " of shape " + dims_text(x.dims()) + " is not divisible by the group size " +
                                std::to_string(group));
}

void check_pairs(const CollectiveSpec& spec) {
  if (spec.pairs.empty()) throw std::invalid_argument("collective_permute needs at least one (source, target) pair");
  std::set<int64_t> sources, targets;
  for (const auto& [s, t] : spec.pairs) {
    if (s < 0 || s >= spec.replicas || t < 0 || t >= spec.replicas)
      throw std::invalid_argument("collective_permute pair (" + std::to_string(s) + ", " + std::to_string(t) +
                                  ") names a replica outside 0.." + std::to_string(spec.replicas - 1));
    if (!sources.insert(s).second || !targets.insert(t).second)
      throw std::invalid_argument("collective_permute: every source and every target may appear once");
  }
}

// The unsigned integer type as wide as `t` (its bits), u8 for pred.
ElementType bits_type(ElementType t) {
  switch (byte_size(t)) {
    case 1: return ElementType::U8;
    case 2: return ElementType::U16;
    case 4: return ElementType::U32;
    default: return ElementType::U64;
  }
}

// Broadcast as an integer sum of the root's bits and everyone else's zeros:
// bit-exact for every real dtype (-0.0, NaN payloads) at all_reduce's cost.
Value broadcast_bits(Builder& b, Value x, const CollectiveSpec& spec, const Builder::ReplicaGroups& groups) {
  const ElementType element = x.element(), bits = bits_type(element);
  TensorType bits_t{bits, x.dims()};
  Value v = element == ElementType::Pred ? b.convert(x, bits) : b.bitcast_convert(x, bits_t);
  Value id = b.replica_id(), is_root = b.constant_bool(false);
  for (const Dims& g : groups) {
    Value root_id = b.constant_int(g[spec.root], ElementType::U32);
    is_root = b.binary("or", is_root, b.compare(id, root_id, hlo::Compare::EQ));
  }
  Value mask = b.broadcast_in_dim(is_root, x.dims(), {});
  Value sum = b.all_reduce(b.select(mask, v, b.constant_int(0, bits, x.dims())), hlo::Reducer::Add, groups);
  return element == ElementType::Pred ? b.convert(sum, element) : b.bitcast_convert(sum, x.type);
}

// Complex numbers (no bitcast in XLA): gather every replica's value on a new leading dim, keep the root's.
Value broadcast_by_gather(Builder& b, Value x, int64_t root, const Builder::ReplicaGroups& groups) {
  Dims one = x.dims();
  one.insert(one.begin(), 1);
  Value all = b.all_gather(b.reshape(x, one), 0, groups);
  Dims start(one.size(), 0), limit = all.dims(), strides(one.size(), 1);
  start[0] = root;
  limit[0] = root + 1;
  return b.reshape(b.slice(all, start, limit, strides), x.dims());
}

Value lower(Builder& b, Value x, const CollectiveSpec& spec) {
  const Builder::ReplicaGroups groups = checked_groups(spec);
  const int64_t group = static_cast<int64_t>(groups[0].size());
  switch (spec.kind) {
    case Collective::AllReduce:
      return reduce_across(b, x, spec, groups, false, 0);
    case Collective::ReduceScatter:
      check_divisible(spec, x, group);
      return reduce_across(b, x, spec, groups, true, spec.dim);
    case Collective::AllGather:
      check_divisible(spec, x, group);
      return b.all_gather(x, spec.dim, groups);
    case Collective::AllToAll:
      check_divisible(spec, x, group);
      return b.all_to_all(x, spec.dim, groups);
    case Collective::Permute:
      check_pairs(spec);
      return b.collective_permute(x, spec.pairs);
    case Collective::Broadcast:
      if (spec.root < 0 || spec.root >= group)
        throw std::invalid_argument("broadcast root " + std::to_string(spec.root) + " is outside the group of " +
                                    std::to_string(group));
      return is_complex(x.element()) ? broadcast_by_gather(b, x, spec.root, groups) : broadcast_bits(b, x, spec, groups);
  }
  throw std::invalid_argument("unknown collective");
}

}  // namespace

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::AllReduce: return "all_reduce";
    case Collective::AllGather: return "all_gather";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllToAll: return "all_to_all";
    case Collective::Permute: return "collective_permute";
    case Collective::Broadcast: return "broadcast";
  }
  return "collective";
}

CollectiveProgram collective_program(const CollectiveSpec& spec) {
  if (spec.replicas < 1) throw std::invalid_argument("a collective needs at least one replica");
  Builder b;
  // Storages are flat buffers: read the dense input from one, return the result as one.
  Value flat = b.parameter(TensorType{spec.element, {count_of(spec.dims)}});
  Value out = lower(b, b.reshape(flat, spec.dims), spec);
  CollectiveProgram program;
  program.out_dims = out.dims();
  program.text = b.finish({b.reshape(out, {count_of(out.dims())})});
  return program;
}

}  // namespace torch_pjrt::lowering
