// The lowering context over a real call: CallContext answers a lowering's questions (lowering::Context) from
// the call's arguments, gives each storage, Scalar, offset, stride and length its parameter (once each), and
// reads capacity storages and runtime-length tensors padded. emit() turns the lowering's results into each
// output's new flat storage value; compile_alone, learn_operands and emit_op are its three users.
#include "aten/call_context.h"
#include "aten/op_signature.h"

#include <ATen/ATen.h>
#include <ATen/native/TypeProperties.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/growth.h"
#include "aten/lowering.h"
#include "aten/op_call.h"
#include "aten/profiling.h"
#include "graph/metrics.h"
#include "graph/strided_view.h"

namespace torch_pjrt {

namespace {

class CallContext final : public lowering::Context {
 public:
  CallContext(lowering::Builder& b, Call& call, const MetaResult& meta, bool bake, GraphValues* graph = nullptr)
      : Context(b), call_(call), meta_(meta), bake_(bake), graph_(graph) {}

  std::vector<OperandRef> operands;

  int index(std::string_view name) const {
    auto i = call_.schema.argumentIndexWithName(name);
    if (!i) throw lowering::Unsupported("internal: " + call_.schema.name() + " has no argument '" + std::string(name) + "'");
    return static_cast<int>(*i);
  }
  const c10::IValue& arg(std::string_view name) const { return call_.args[index(name)]; }

  // Boxed calls pass an absent Tensor? either as None or as an undefined tensor.
  static bool absent(const c10::IValue& v) { return is_absent(v); }

  bool has(std::string_view name) const override {
    auto i = call_.schema.argumentIndexWithName(name);
    return i && !absent(call_.args[*i]);
  }

  bool is_tensor(std::string_view name) const override {
    auto i = call_.schema.argumentIndexWithName(name);
    return i && call_.args[*i].isTensor() && call_.args[*i].toTensor().defined();
  }

  std::vector<std::string> tensor_arguments() const override {
    std::vector<std::string> names;
    for (const auto& a : call_.schema.arguments())  // the functional form's: out= tensors are results
      if (a.type()->kind() == c10::TypeKind::TensorType && !(a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite()))
        names.push_back(a.name());
    return names;
  }

  std::vector<std::string> non_default_arguments() const override { return torch_pjrt::non_default_arguments(call_); }

  // The whole storage of a tpu tensor as a parameter, once per storage.
  // In a fused graph, a storage an earlier op wrote is that op's value.
  std::optional<Value> storage_param(const at::Tensor& t, int arg, int item) {
    const StorageState& st = storage_state(t.storage());
    auto& params = graph_ ? graph_->values : storage_params_;
    auto it = params.find(&st);
    if (it != params.end()) return it->second;
    std::optional<lowering::TensorType> type;
    if (!graph_) {
      type = keyed_type(st);
    } else if (auto in = graph_->inputs.find(&st); in != graph_->inputs.end()) {
      type = in->second;
    }
    if (!type) return std::nullopt;
    Value p = b.parameter(*type);
    operands.push_back(OperandRef{OperandRef::Storage, arg, item});
    params.emplace(&st, p);
    if (graph_) graph_->originals.emplace(&st, p);
    return p;
  }

  // The parameter of a storage the op read (strict/debug programs), if any.
  std::optional<Value> original(const StorageState* st) const {
    auto it = storage_params_.find(st);
    return it == storage_params_.end() ? std::nullopt : std::optional<Value>(it->second);
  }

  // The type the op's signature saw: the plan cached under that signature
  // must not depend on what another thread installed since.
  std::optional<lowering::TensorType> keyed_type(const StorageState& st) const {
    const KeyedStorage* keyed = find_keyed(call_, &st);
    return keyed ? keyed->type : storage_type(st);
  }
  // Its extent when keyed: a fused graph lowers a recorded op after the storage may have been freed.
  size_t keyed_extent(const StorageState& st) const {
    const KeyedStorage* keyed = find_keyed(call_, &st);
    return keyed ? keyed->extent : extent_bytes(st);
  }

  // A storage offset of 0 stays static (the common case, the simplest
  // program); any other is a runtime s64 operand, as Scalars are, so a loop
  // over slices of one tensor reuses one program (the signature records
  // only "zero or not"). One operand per tensor argument, read or written.
  //
  // A strided view of a capacity storage (`ids[:, -1:]` of a batch of growing
  // sequences) takes its strides at runtime too: they grow with the sequence,
  // and the program, read with a gather, stays the same.
  graph::StridedView view_of(const at::Tensor& t, int arg, int item) {
    graph::StridedView view{element_or_throw(t.scalar_type()), lowering::Dims(t.sizes().begin(), t.sizes().end()),
                            lowering::Dims(t.strides().begin(), t.strides().end()), 0};
    if (t.storage_offset() != 0) view.runtime_offset = runtime_int(OperandRef{OperandRef::Offset, arg, item, ElementType::S64});
    if (storage_state(t.storage()).capacity > 0 && !view.is_dense_row_major()) {
      view.runtime_strides.resize(view.sizes.size());
      for (size_t d = 0; d < view.sizes.size(); ++d) {
        OperandRef ref{OperandRef::Stride, arg, item, ElementType::S64};
        ref.dim = static_cast<int>(d);
        if (view.sizes[d] != 1) view.runtime_strides[d] = runtime_int(ref);
      }
    }
    return view;
  }
  // An s64[] operand from a tensor argument's metadata, once per (kind, argument, item, dim).
  Value runtime_int(const OperandRef& ref) {
    auto key = std::make_tuple(static_cast<int>(ref.kind), ref.arg, ref.item, ref.dim);
    auto it = runtime_ints_.find(key);
    if (it == runtime_ints_.end())
      it = runtime_ints_.emplace(key, operand_param(lowering::TensorType{ElementType::S64, {}}, ref)).first;
    return it->second;
  }
  int64_t storage_count(const at::Tensor& t) const {
    return static_cast<int64_t>(keyed_extent(storage_state(t.storage())) / t.element_size());
  }

  // As planned: a recorded op is lowered later from a snapshot of its arguments (without autograd's requires_grad).
  int64_t flat_capacity() const override { return meta_.flat_capacity; }
  int64_t flat_rows() const override { return meta_.flat_rows; }
  std::vector<FlatPiece> flat_pieces(std::string_view name) override {
    const bool rows = flat_rows() > 1;
    int i = index(name);
    std::vector<FlatPiece> pieces;
    auto list = call_.args[i].toTensorList();
    for (size_t k = 0; k < list.size(); ++k) {
      at::Tensor t = list.get(k);
      int item = static_cast<int>(k);
      Value data;
      if (!t.is_contiguous()) {  // a later piece (flat_cat_pieces): its values, in order
        data = b.reshape(value_of(t, i, item), {t.numel()});
      } else {
        graph::StridedView view = view_of(t, i, item);
        int64_t count = storage_count(t);
        data = graph::storage_as(b, storage_param(t, i, item), view.element, count);
        if (view.runtime_offset) {  // from the piece's start; padded so the slice never clamps
          Value padded = b.pad(data, b.constant(0, data.element()), {0}, {count}, {0});
          data = b.dynamic_slice(padded, {*view.runtime_offset}, {count});
        }
      }
      std::optional<Value> start, length;
      if (k > 0 && !rows) start = runtime_int(OperandRef{OperandRef::Position, i, item, ElementType::S64});
      if (rows) length = runtime_int(OperandRef{OperandRef::Length, i, item, ElementType::S64});
      pieces.push_back(FlatPiece{data, start, length});
    }
    return pieces;
  }

  std::optional<Padded> padded(std::string_view name, int64_t dim) override {
    int i = index(name);
    if (!call_.args[i].isTensor()) return std::nullopt;
    const at::Tensor& t = call_.args[i].toTensor();
    if (!t.defined() || t.device().type() != kTpu || t.dim() == 0 || t.numel() == 0 || !t.is_contiguous() ||
        t.storage_offset() != 0 || t.is_conj() || t.is_neg() || storage_state(t.storage()).capacity == 0)
      return std::nullopt;
    dim = lowering::wrap_dim(dim, t.dim());
    int64_t rows = 1, inner = 1;
    for (int64_t d = 0; d < dim; ++d) rows *= t.size(d);
    for (int64_t d = dim + 1; d < t.dim(); ++d) inner *= t.size(d);
    const int64_t count = storage_count(t), bound = count / (rows * inner);
    if (bound < t.size(dim)) return std::nullopt;
    // Row r of the [rows, size * inner] tensor starts at r * size * inner; its first bound * inner elements
    // stay in bounds, since rows * bound * inner <= count.
    const ElementType s64 = ElementType::S64;
    Value size = runtime_int(OperandRef{OperandRef::Size, i, -1, s64, 0, static_cast<int>(dim)});
    Value flat = graph::storage_as(b, storage_param(t, i, -1), element_or_throw(t.scalar_type()), count);
    Value row_length = b.binary("multiply", size, b.constant_int(inner, s64));
    Value values = lowering::gather_rows(b, flat, row_length, rows, bound * inner);
    lowering::Dims dims(t.sizes().begin(), t.sizes().end());
    dims[dim] = bound;
    return Padded{b.reshape(values, dims), size};
  }

  // A runtime-length op's tensor holding the length in its last dim (runtime_length_of): read padded.
  bool length_padded(const at::Tensor& t) const {
    return meta_.length_bound > 0 && meta_.length_arg >= 0 && t.defined() && t.device().type() == kTpu &&
           t.dim() > 0 && t.size(-1) == runtime_length(call_, meta_) && storage_state(t.storage()).capacity > 0;
  }
  // The call's runtime length, an s64[] operand.
  Value length_value() {
    const at::Tensor t = item_tensor(call_.args[meta_.length_arg], meta_.length_item);
    return runtime_int(OperandRef{OperandRef::Size, meta_.length_arg, meta_.length_item, ElementType::S64, 0,
                                  static_cast<int>(t.dim() - 1)});
  }
  std::optional<Value> runtime_size(std::string_view name, int64_t dim) override {
    auto i = call_.schema.argumentIndexWithName(name);
    if (!i || !call_.args[*i].isTensor()) return std::nullopt;
    const at::Tensor& t = call_.args[*i].toTensor();
    if (!length_padded(t) || lowering::wrap_dim(dim, t.dim()) != t.dim() - 1) return std::nullopt;
    return length_value();
  }
  // Rows of the storage at the runtime length, padded to the bound with the entry's padding.
  Value read_length_padded(const at::Tensor& t, int arg, int item) {
    const int64_t bound = meta_.length_bound, rows = t.numel() / t.size(-1);
    const ElementType e = element_or_throw(t.scalar_type());
    Value flat = graph::storage_as(b, storage_param(t, arg, item), e, storage_count(t));
    Value length = length_value();
    Value block = lowering::gather_rows(b, flat, length, rows, bound);
    const lowering::Dims dims{rows, bound};
    Value lane = b.iota(lowering::TensorType{ElementType::S64, dims}, 1);
    Value fill = b.broadcast_in_dim(b.convert(b.constant(meta_.length_padding, ElementType::F64), e), dims, {});
    block = b.select(b.compare(lane, b.broadcast_in_dim(length, dims, {}), hlo::Compare::LT), block, fill);
    lowering::Dims sizes(t.sizes().begin(), t.sizes().end());
    sizes.back() = bound;
    return b.reshape(block, sizes);
  }
  // A padded result as its storage's flat buffer of `count` elements (rows at the runtime length).
  Value pack_length_padded(const Value& r, int64_t count) {
    const int64_t bound = meta_.length_bound, rows = r.type.element_count() / bound;
    if (rows == 1 && count == bound) return b.reshape(r, {count});  // one row (arange): already in place
    return lowering::pack_rows(b, b.reshape(r, {rows, bound}), length_value(), count);
  }

  Value value_of(const at::Tensor& t, int arg, int item) {
    auto key = std::make_pair(arg, item);
    auto it = values_.find(key);
    if (it != values_.end()) return it->second;
    Value v;
    if (length_padded(t)) {
      v = read_length_padded(t, arg, item);
    } else if (meta_.capacity > 0 && t.device().type() == kTpu && t.dim() > 0) {  // capacity_elementwise_of: the whole buffer
      if (storage_count(t) != meta_.capacity) throw lowering::Unsupported("internal: capacity mismatch");
      v = graph::storage_as(b, storage_param(t, arg, item), element_or_throw(t.scalar_type()), meta_.capacity);
    } else if (t.device().type() == kTpu) {
      graph::StridedView view = view_of(t, arg, item);
      Value flat = graph::storage_as(b, storage_param(t, arg, item), view.element, storage_count(t));
      v = read_through_bits(t, graph::read_view(b, flat, view));
    } else {
      v = operand_param(lowering::TensorType{element_or_throw(t.scalar_type()),
                                             lowering::Dims(t.sizes().begin(), t.sizes().end())},
                        OperandRef{OperandRef::Host, arg, item});
    }
    values_.emplace(key, v);
    return v;
  }

  // A tensor with PyTorch's lazy conjugate or negative bit holds data whose
  // value is conj(data) or -data. Ops that reach the device with the bit set
  // (copy_, clone, mm: PyTorch's fallback lets them through) see the value;
  // writing into such a tensor stores the inverse (the same function).
  Value read_through_bits(const at::Tensor& t, Value v) {
    if (t.is_conj()) v = b.conj(v);
    if (t.is_neg()) v = b.unary("negate", v);
    return v;
  }

  Value tensor(std::string_view name) override {
    int i = index(name);
    if (!call_.args[i].isTensor()) throw lowering::Unsupported(std::string(name) + " is not a tensor");
    return value_of(call_.args[i].toTensor(), i, -1);
  }

  std::vector<std::optional<Value>> tensor_list(std::string_view name) override {
    int i = index(name);
    const auto& v = call_.args[i];
    std::vector<std::optional<Value>> out;
    size_t n = v.isTensorList() ? v.toTensorList().size() : v.toList().size();
    for (size_t k = 0; k < n; ++k) {
      at::Tensor t = item_tensor(v, static_cast<int>(k));
      if (t.defined()) out.push_back(value_of(t, i, static_cast<int>(k)));
      else out.push_back(std::nullopt);
    }
    return out;
  }

  Value scalar(std::string_view name, ElementType as) override {
    return operand_param(lowering::TensorType{as, {}}, OperandRef{OperandRef::Scalar, index(name), -1, as});
  }
  ElementType scalar_kind(std::string_view name) const override {
    const auto& v = arg(name);
    return v.isDouble() ? ElementType::F64 : v.isBool() ? ElementType::Pred : v.isComplexDouble() ? ElementType::C128 : ElementType::S64;
  }
  double scalar_value(std::string_view name) const override {
    if (!bake_) throw lowering::Unsupported("internal: scalar_value needs a lowering registered with bake_scalars");
    return arg(name).toScalar().toDouble();
  }
  int64_t int_arg(std::string_view name) const override { return arg(name).toInt(); }
  double float_arg(std::string_view name) const override { return arg(name).toDouble(); }
  bool bool_arg(std::string_view name) const override { return arg(name).toBool(); }
  std::vector<bool> bool_list(std::string_view name) const override {
    std::vector<bool> out;
    for (const c10::IValue& x : arg(name).toList()) out.push_back(x.toBool());
    return out;
  }
  lowering::Dims int_list(std::string_view name) const override {
    const auto& v = arg(name);
    if (v.isInt()) return {v.toInt()};
    return v.toIntVector();
  }
  std::string string_arg(std::string_view name) const override { return arg(name).toStringRef(); }
  ElementType tensor_element(std::string_view name) const override {
    return element_or_throw(arg(name).toTensor().scalar_type());
  }
  lowering::Dims tensor_dims(std::string_view name) const override {
    const at::Tensor& t = arg(name).toTensor();
    auto s = t.sizes();
    if (meta_.capacity > 0 && !s.empty()) return {meta_.capacity};
    lowering::Dims dims(s.begin(), s.end());
    if (length_padded(t)) dims.back() = meta_.length_bound;
    return dims;
  }
  size_t output_count() const override { return meta_.outputs.size(); }
  const OutputMeta& output(size_t i) const override { return meta_.outputs.at(i); }

  ElementType promoted(const std::vector<std::string_view>& names) const override {
    at::native::ResultTypeState state{};
    for (auto name : names) {
      const auto& v = arg(name);
      if (v.isTensor()) state = at::native::update_result_type_state(v.toTensor(), state);
      else if (v.isScalar()) state = at::native::update_result_type_state(v.toScalar(), state);
    }
    return element_or_throw(at::native::result_type(state));
  }

  Value rng_state(int64_t count) override {
    auto i = call_.schema.argumentIndexWithName("generator");
    return operand_param(lowering::TensorType{ElementType::U64, {2}},
                         OperandRef{OperandRef::Rng, i ? static_cast<int>(*i) : -1, -1, ElementType::U64,
                                    static_cast<uint64_t>(count)});
  }

 private:
  // A parameter for an operand that is not a storage. In a fused graph the
  // same buffer (a cached Scalar such as alpha=1) is one parameter however
  // many ops use it: thousands of duplicate parameters made XLA's compile
  // time grow quadratically with the op count.
  Value operand_param(const lowering::TensorType& type, const OperandRef& ref) {
    operands.push_back(ref);
    if (!graph_ || !graph_->operand_ids) return b.parameter(type);
    if (graph_->next_operand >= graph_->operand_ids->size())
      throw lowering::Unsupported("internal: the op asks for more operands than it recorded");
    int id = (*graph_->operand_ids)[graph_->next_operand++];
    auto it = graph_->params.find(id);
    if (it != graph_->params.end()) {
      if (!(it->second.type == type))
        throw lowering::Unsupported("internal: a shared operand is " + it->second.type.str() + ", not " + type.str());
      return it->second;
    }
    Value p = b.parameter(type);
    graph_->params.emplace(id, p);
    return p;
  }

  Call& call_;
  const MetaResult& meta_;
  bool bake_;
  GraphValues* graph_;
  std::unordered_map<const StorageState*, Value> storage_params_;
  std::map<std::pair<int, int>, Value> values_;
  std::map<std::tuple<int, int, int, int>, Value> runtime_ints_;  // offsets, strides, lengths (runtime_int)
};

// Lowers one op into `b`. Returns one flat value per present output: the
// whole new storage of a written argument, or the dense new tensor.
std::vector<Value> emit(lowering::Builder& b, Call& call, const CachedOp& cached, CallContext& ctx) {
  const MetaResult& meta = cached.meta;
  b.set_float32_precision(cached.float32_precision);
  std::vector<Value> results = cached.entry->fn(ctx);
  if (meta.flat_capacity > 0) return results;  // already the result's flat buffer, of its capacity
  if (meta.capacity > 0) {  // whole flat buffers, written ones included
    std::vector<Value> flats;
    for (size_t i = 0; i < results.size() && i < meta.outputs.size(); ++i) {
      if (cached.outputs[i].absent) continue;
      Value r = b.convert(b.convert(results[i], meta.outputs[i].element), element_or_throw(cached.outputs[i].dtype));
      if (r.dims() != lowering::Dims{meta.capacity}) r = lowering::broadcast_to(b, r, {meta.capacity});
      flats.push_back(r);
    }
    return flats;
  }
  if (results.size() != meta.outputs.size())
    throw lowering::Unsupported("internal: lowering returned " + std::to_string(results.size()) + " values, expected " +
                                std::to_string(meta.outputs.size()));
  std::vector<Value> flats;
  for (size_t i = 0; i < results.size(); ++i) {
    if (cached.outputs[i].absent) continue;
    const OutputMeta& m = meta.outputs[i];
    Value r = b.convert(b.convert(results[i], m.element), element_or_throw(cached.outputs[i].dtype));
    if (r.dims() != m.dims) {
      // In-place ops may produce a broadcastable shape; anything else is a bug.
      if (r.type.element_count() == lowering::TensorType{m.element, m.dims}.element_count() || r.rank() <= static_cast<int64_t>(m.dims.size()))
        r = lowering::broadcast_to(b, r, m.dims);
      else
        throw lowering::Unsupported("internal: lowering produced shape " + r.type.str());
    }
    if (meta.length_bound > 0 && meta.padded_outputs[i]) {  // runtime_length_of: the whole (capacity) storage
      int64_t count = r.type.element_count();
      if (cached.outputs[i].write)
        count = ctx.storage_count(item_tensor(call.args[cached.outputs[i].arg], cached.outputs[i].item));
      flats.push_back(ctx.pack_length_padded(r, count));
    } else if (cached.outputs[i].write) {
      if (r.dims() != cached.outputs[i].dims) r = b.reshape(r, cached.outputs[i].dims);  // keeps_out_shape
      at::Tensor target = item_tensor(call.args[cached.outputs[i].arg], cached.outputs[i].item);
      graph::StridedView view = ctx.view_of(target, cached.outputs[i].arg, cached.outputs[i].item);
      int64_t count = ctx.storage_count(target);
      bool covers_all = view.is_dense_row_major() && !view.runtime_offset && view.numel() == count;
      Value flat = covers_all ? b.constant(0, view.element, {count})  // unused: folded away
                              : graph::storage_as(b, ctx.storage_param(target, cached.outputs[i].arg, cached.outputs[i].item),
                                                  view.element, count);
      flats.push_back(graph::write_view(b, flat, ctx.read_through_bits(target, r), view));
    } else if (cached.outputs[i].strides.empty()) {
      flats.push_back(b.reshape(r, {r.type.element_count()}));
    } else {  // a dense layout other than row-major: the value in memory order
      graph::StridedView view{r.element(), m.dims, cached.outputs[i].strides, 0};
      flats.push_back(graph::write_view(b, b.constant(0, r.element(), {view.numel()}), r, view));
    }
  }
  return flats;
}
std::string g_compile_fault_op;
bool g_compile_fault_located = false;
CheckInfos check_infos_of(const Call& call, const std::vector<lowering::RuntimeCheck>& checks) {
  auto infos = std::make_shared<std::vector<CheckInfo>>();
  add_check_infos(*infos, checks, describe_call(call.schema, call.args), 0);
  return infos;
}
// Strict and debug modes: an op recorded at the same user line with a new
// signature is a recompile; it is noted with what changed, for torch_pjrt.explain().
void note_op_recompile(int device, const std::string& name, const std::string& description,
                       graph::SourceLocation location) {
  device_context(device).with_recompile_history([&](RecompileHistory& h) {
    auto [it, first] = h.op_signatures.try_emplace({name, location}, description);
    if (first) return;
    std::string reason = name + " at " + graph::describe_source_location(location) + " recompiled: " + description +
                         " where the previous compile had " + it->second;
    if (it->second == description)
      reason += " (same shapes and dtypes: strides, storage offset, aliasing or other arguments differ)";
    graph::note_recompile_reason(std::move(reason));
    it->second = description;
  });
}

// A strict op whose check fails writes nothing: each storage it rewrites
// after reading it is selected on its checks, as a fused graph's results are
// (runtime_checks.h). `flats` follows the op's present outputs.
void keep_values_on_failed_check(lowering::Builder& b, const Call& call, const CachedOp& cached, const CallContext& ctx,
                                 std::vector<Value>& flats) {
  Value ok = ctx.checks.front().ok;
  for (size_t k = 1; k < ctx.checks.size(); ++k) ok = b.binary("and", ok, ctx.checks[k].ok);
  size_t flat = 0;
  for (const OutputPlan& p : cached.outputs) {
    if (p.absent) continue;
    Value& v = flats[flat++];
    if (!p.write) continue;
    std::optional<Value> old = ctx.original(&storage_state(item_tensor(call.args[p.arg], p.item).storage()));
    if (old && old->type == v.type) v = b.select(b.broadcast_in_dim(ok, v.dims(), {}), v, *old);
  }
}

}  // namespace

// Strict and debug modes: the op as a program of its own.
void compile_alone(Call& call, CachedOp& cached, graph::SourceLocation location) {
  std::string description = describe_call(call.schema, call.args);
  note_op_recompile(call.device, op_name(call.schema), description, location);
  ProfileScope profile([&] { return std::pair{"torch_pjrt::compile(" + description + ")", description}; });
  lowering::Builder b;
  b.set_location(op_location(call.schema, location));
  CallContext ctx(b, call, cached.meta, cached.entry->bake_scalars);
  std::vector<Value> flats = emit(b, call, cached, ctx);
  cached.operands = std::move(ctx.operands);
  cached.compile_cost = b.compile_cost();
  cached.operands_known = true;
  // Small programs compile at a lower optimization level: 2-3x faster to
  // compile, and a kernel over at most this many elements runs microseconds
  // longer (benchmarks/bench_compile.py).
  constexpr int64_t kQuickElements = int64_t{1} << 16;
  int64_t largest = 0;
  for (const lowering::TensorType& t : b.parameters()) largest = std::max(largest, t.element_count());
  for (const Value& v : flats) largest = std::max(largest, v.type.element_count());
  auto effort = largest <= kQuickElements ? graph::Effort::Quick : graph::Effort::Full;
  if (!ctx.checks.empty()) {
    keep_values_on_failed_check(b, call, cached, ctx, flats);
    flats.push_back(lowering::check_status(b, ctx.checks));
    cached.checks = check_infos_of(call, ctx.checks);
  }
  cached.program = compile_cache().get_or_compile(b.finish(flats), call.device, effort);
}

// Fused modes: learns the op's operand order without compiling anything.
void learn_operands(Call& call, CachedOp& cached) {
  lowering::Builder b;
  CallContext ctx(b, call, cached.meta, cached.entry->bake_scalars);
  emit(b, call, cached, ctx);
  cached.operands = std::move(ctx.operands);
  if (!ctx.checks.empty()) cached.checks = check_infos_of(call, ctx.checks);
  cached.compile_cost = b.compile_cost();
  cached.operands_known = true;
}

void inject_compile_fault(const std::string& name, bool located) {
  g_compile_fault_op = name;
  g_compile_fault_located = located;
}

std::vector<Value> emit_op(lowering::Builder& b, Call& call, const CachedOp& cached, GraphValues* graph,
                           std::vector<lowering::RuntimeCheck>* checks) {
  CallContext ctx(b, call, cached.meta, cached.entry->bake_scalars, graph);
  std::vector<Value> flats = emit(b, call, cached, ctx);
  if (checks) *checks = std::move(ctx.checks);
  if (graph && !g_compile_fault_op.empty() && !flats.empty() && op_name(call.schema) == g_compile_fault_op) {
    // Located: a call to a function the module lacks, which the StableHLO
    // verifier reports at the op's location. Else a kernel no plugin has,
    // which XLA reports later without one.
    flats[0] = g_compile_fault_located
                   ? b.call("torch_pjrt_injected_fault", "", {flats[0]}, {flats[0].type})[0]
                   : b.custom_call("torch_pjrt_injected_fault", {flats[0]}, flats[0].type);
  }
  return flats;
}

void prepare_rule(Call& call, CachedOp& cached) {
  lowering::Builder scratch;
  CallContext ctx(scratch, call, cached.meta, cached.entry->bake_scalars);
  cached.entry->prepare(ctx);
}

}  // namespace torch_pjrt
