// What identifies an op call: the schema's facts (built once per schema and thread), the dtype and storage-type
// mapping, the written arguments, and the key (KeyBuilder) that the device's plan cache looks plans up by.
// Everything here reads the call; nothing plans, lowers or runs it.
#include "aten/op_signature.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "aten/device.h"

namespace torch_pjrt {

namespace {

bool is_scalar_arg(const c10::Argument& a) {
  auto kind = a.type()->kind();
  if (kind == c10::TypeKind::OptionalType) kind = a.type()->castRaw<c10::OptionalType>()->getElementType()->kind();
  return kind == c10::TypeKind::NumberType;
}
struct KeyBuilder {
  std::string key;
  bool supported = true;
  std::string why;
  bool allow_host = false;                         // CPU tensors of any rank may come in
  // Two arguments share a storage and some offset is not in the key: whether
  // they overlap (ATen's overlap errors) must be checked on every call.
  bool shared_storage = false, runtime_offset = false;  // runtime_offset: or runtime strides (runtime_strides())
  bool complex = false;                            // a complex tensor or Scalar argument
  bool shapeless = false;                          // a flat cat: tensors' sizes and strides stay out of the key
  int64_t runtime_length = 0;  // a runtime-length op: a tpu tensor's last dim of this size is keyed as 'n'

  void num(int64_t v) { append_key_number(key, v); }
  void tensor(const at::Tensor& t, Call& call) {
    if (!t.defined()) {
      key += 'u';
      return;
    }
    auto e = element_of(t.scalar_type());
    if (!e) {
      supported = false;
      why = std::string("dtype ") + c10::toString(t.scalar_type());
      return;
    }
    key += static_cast<char>('A' + static_cast<int>(*e));
    complex = complex || is_complex(*e);
    // Lazy conjugate / negative views: the value read is conj(data) / -data.
    if (t.is_conj()) key += '*';
    if (t.is_neg()) key += '~';
    // A flat cat's strided piece is read through its strides: they and its sizes are in the key.
    const bool layout = !shapeless || (t.device().type() == kTpu && !t.is_contiguous());
    // runtime_length_of: such a tensor is contiguous, read padded to the bound in the key.
    const bool length_dim = runtime_length > 0 && t.device().type() == kTpu && t.dim() > 0 && t.size(-1) == runtime_length;
    if (length_dim) {
      for (int64_t d = 0; d + 1 < t.dim(); ++d) num(t.size(d));
      key += 'n';
    } else if (layout) {
      for (int64_t s : t.sizes()) num(s);
    } else {
      key += 'r';  // the rank still decides broadcasting and type promotion (a 0-d tensor)
      num(t.dim());
    }
    if (t.device().type() == kTpu) {
      if (call.device < 0) call.device = t.device().index();
      TORCH_CHECK(call.device == t.device().index(), "Expected all tensors to be on the same device, but found ",
                  "tpu:", call.device, " and ", t.device(), " in ", call.schema.name());
      key += 't';
      const StorageState& st = storage_state(t.storage());
      if (length_dim) {
        key += 'C';
      } else if (layout && st.capacity > 0 && !t.is_contiguous()) {
        runtime_strides(t);
        runtime_offset = true;  // overlap with another argument is checked per call
      } else if (layout) {
        for (int64_t s : t.strides()) num(s);
      }
      key += t.storage_offset() == 0 ? '0' : 'o';  // a nonzero offset is a runtime operand
      runtime_offset = runtime_offset || t.storage_offset() != 0;
      std::optional<lowering::TensorType> type = checked_storage_type(st);
      // A capacity storage keys by its capacity. A fresh destination of an op over capacity storages
      // (`mask.bool()`: empty, then copy_) takes the op's capacity (adopt_capacity): its size is no part.
      if (!type && st.capacity == 0 && (shapeless || length_dim)) key += 'F';
      else num(static_cast<int64_t>(extent_bytes(st)));
      if (st.capacity > 0) key += 'k';  // its strided views read at runtime strides (CallContext::view_of)
      if (type) {
        key += static_cast<char>('a' + static_cast<int>(type->element));
        num(type->element_count());
      } else {
        key += 'z';
      }
      // Aliasing pattern: the storage's index in order of first use (a call has few: a linear scan).
      auto& seen = call.keyed_storages;
      auto it = std::find_if(seen.begin(), seen.end(), [&](const KeyedStorage& keyed) { return keyed.state == &st; });
      bool fresh = it == seen.end();
      num(it - seen.begin());
      if (fresh) seen.push_back(KeyedStorage{&st, type, extent_bytes(st)});
      shared_storage = shared_storage || !fresh;
    } else if (t.device().is_cpu()) {
      // As on CUDA: CPU tensors mix in only as 0-d values, copy sources and
      // index lists; anything else is the user's device mix-up.
      TORCH_CHECK(t.dim() == 0 || allow_host, "Expected all tensors to be on the same device, but found at least two ",
                  "devices, tpu:", std::max(call.device, 0), " and cpu! (in ", call.schema.name(), ")");
      key += t.unsafeGetTensorImpl()->is_wrapped_number() ? 'w' : 'c';
    } else {
      supported = false;
      why = "a tensor on " + t.device().str();
    }
  }
  // A strided view of a capacity storage (`ids[:, -1:]` of a batch of growing sequences) is read
  // at runtime strides (CallContext::view_of), which grow with the sequence. The key holds what
  // meta kernels decide output layouts from: the strides of size-1 dims, which other strides are
  // zero or larger than which, density and the suggested memory format.
  void runtime_strides(const at::Tensor& t) {
    const auto sizes = t.sizes(), strides = t.strides();
    key += 'v';
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 1) num(strides[d]);
      else key += strides[d] == 0 ? 'z' : 's';
    }
    for (size_t i = 0; i < sizes.size(); ++i)
      for (size_t j = i + 1; j < sizes.size(); ++j)
        if (sizes[i] != 1 && sizes[j] != 1) key += strides[i] < strides[j] ? '<' : strides[i] == strides[j] ? '=' : '>';
    key += t.is_non_overlapping_and_dense() ? 'D' : 'd';
    key += static_cast<char>('0' + static_cast<int>(t.suggest_memory_format()));
  }
  void value(const c10::IValue& v, const c10::Argument& a, bool bake_scalars, Call& call) {
    if (v.isNone()) {
      key += 'N';
    } else if (v.isTensor()) {
      tensor(v.toTensor(), call);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      key += 'L';
      num(static_cast<int64_t>(list.size()));
      for (size_t i = 0; i < list.size(); ++i) tensor(list.get(i), call);
    } else if (v.isList() && a.type()->str().find("Tensor") != std::string::npos) {
      auto list = v.toList();
      key += 'O';
      num(static_cast<int64_t>(list.size()));
      bool was_allowed = allow_host;
      allow_host = true;  // index lists: CPU indices are fine, as on CUDA
      for (size_t i = 0; i < list.size(); ++i) {
        auto item = list.get(i);
        if (item.isNone()) {
          key += 'N';
          continue;
        }
        auto type = item.toTensor().scalar_type();
        if (type == at::kBool || type == at::kByte) {
          supported = false;
          why = "a boolean mask index (its result's shape depends on the data)";
          return;
        }
        tensor(item.toTensor(), call);
      }
      allow_host = was_allowed;
    } else if (is_scalar_arg(a) && !bake_scalars) {
      key += v.isDouble() ? 'f' : v.isBool() ? 'b' : v.isInt() ? 'i' : v.isComplexDouble() ? 'x' : '?';
      complex = complex || v.isComplexDouble();
    } else if (v.isInt()) {
      key += 'i';
      num(v.toInt());
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, 8);
      key += 'd';
      num(bits);
    } else if (v.isBool()) {
      key += v.toBool() ? "T" : "F";
    } else if (v.isString()) {
      key += 's';
      key += v.toStringRef();
      key += ',';
    } else if (v.isIntList()) {
      key += 'l';
      for (int64_t x : v.toIntVector()) num(x);
      key += ']';
    } else if (v.isDevice()) {
      key += 'D';
      key += v.toDevice().str();
    } else if (v.isGenerator()) {
      key += 'G';
    } else if (v.isList()) {
      key += 'l';
      for (const c10::IValue x : v.toList()) {
        if (x.isInt()) num(x.toInt());
        else if (x.isDouble()) num(static_cast<int64_t>(x.toDouble() * 1e6));
        else if (x.isBool()) num(x.toBool());
        else { supported = false; why = "an argument of type " + a.type()->str(); }
      }
      key += ']';
    } else {
      supported = false;
      why = "an argument of type " + a.type()->str();
    }
    key += '|';
  }
};

// The items of a written Tensor[] argument. Each output replaces its whole
// storage, so two written items in one storage (views of one flat buffer)
// would lose a write: such calls run on the CPU.
bool add_written_items(Call& call, int arg, std::string* why) {
  auto list = call.args[arg].toTensorList();
  for (size_t k = 0; k < list.size(); ++k) {
    const at::Tensor& t = list.get(k);
    if (!t.defined()) continue;
    for (size_t j = 0; j < call.written.size(); ++j) {
      if (written_tensor(call, call.args, j).is_alias_of(t)) {
        *why = "writes two list items that share a storage";
        return false;
      }
    }
    call.written.push_back(arg);
    call.written_items.push_back(static_cast<int>(k));
  }
  return true;
}

}  // namespace

// An argument the op's rule says it writes only under a condition the call does not meet (OpRule::written_only_with).
bool unwritten_here(const Call& call, const SchemaFacts& facts, size_t i) {
  if (!facts.rule) return false;
  for (const auto& [arg, condition] : facts.rule->written_only_with) {
    if (call.schema.arguments()[i].name() != arg) continue;
    auto at = call.schema.argumentIndexWithName(condition);
    return !at || is_absent(call.args[*at]);
  }
  return false;
}

bool collect_written(Call& call, const SchemaFacts& facts, std::string* why) {
  for (size_t i = 0; i < call.args.size(); ++i) {
    if (!facts.writes[i] || is_absent(call.args[i]) || unwritten_here(call, facts, i)) continue;
    if (call.args[i].isTensorList()) {  // fused optimizers: one written entry per item
      if (!add_written_items(call, static_cast<int>(i), why)) return false;
      continue;
    }
    if (!call.args[i].isTensor()) {
      *why = "writes a list of tensors";
      return false;
    }
    call.written.push_back(static_cast<int>(i));
    call.written_items.push_back(-1);
  }
  call.returns_written = !call.schema.returns().empty();
  for (const auto& r : call.schema.returns()) call.returns_written = call.returns_written && r.alias_info();
  return true;
}

void append_key_number(std::string& key, int64_t v) {
  key += std::to_string(v);
  key += ',';
}

std::optional<OpKey> op_key(Call& call, const SchemaFacts& facts, const Growth& growth, std::string* why) {
  const lowering::LoweringEntry& entry = *facts.entry;
  const auto& schema = call.schema;
  KeyBuilder kb;
  kb.allow_host = facts.is_copy;
  kb.key = facts.op_name;
  // Global state meta kernels read: the default dtype (int / int, factories
  // without a dtype, Python floats with integer tensors; the default complex
  // dtype follows it).
  kb.key += static_cast<char>('a' + static_cast<int>(at::get_default_dtype_as_scalartype()));
  // torch.set_float32_matmul_precision: how float32 dots and convolutions compute (never
  // in an elementwise lowering; reading it is a hash lookup per op).
  kb.key += entry.elementwise ? '-' : static_cast<char>('0' + static_cast<int>(float32_precision()));
  if (!entry.key_tag.empty()) {  // a rule registered from Python: its own programs, and refused arguments apart
    kb.key += entry.key_tag;
    for (const std::string& name : non_default_arguments(call)) kb.key += "!" + name;
  }
  const RuntimeLength& length = growth.length;
  if (growth.flat.capacity > 0) {
    kb.shapeless = true;
    kb.key += "flat";
    kb.num(growth.flat.capacity);
    kb.num(growth.flat.rows);  // sizes stay out of the key, the lowering depends on the row count
  } else if (growth.elementwise_capacity > 0) {
    kb.shapeless = true;  // every tensor is 0-d or of one shape, whole buffers of this capacity
    kb.key += "cap";
    kb.num(growth.elementwise_capacity);
  } else if (length.length > 0) {
    kb.runtime_length = length.length;
    kb.key += "len";
    kb.num(length.bound);
  }
  kb.key += '#';
  for (size_t i = 0; i < call.args.size(); ++i) {
    if (call.args[i].isDouble() && facts.runtime_float[i]) {
      kb.key += 'f';  // a runtime operand (Context::scalar): its value is no part of the key
      continue;
    }
    if (length.length > 0 && length.arg < 0 &&
        (schema.arguments()[i].name() == "end" || schema.arguments()[i].name() == "start")) {
      kb.key += 'e';  // arange's length (its result is made per call, its program computes the bound) and start
      continue;
    }
    kb.value(call.args[i], schema.arguments()[i], entry.bake_scalars, call);
    if (!kb.supported) {
      *why = kb.why;
      return std::nullopt;
    }
  }
  return OpKey{std::move(kb.key), kb.shared_storage, kb.runtime_offset, kb.complex};
}

// PyTorch's float32 matmul precision: "highest" (the default) is full float32,
// as on the CPU; "high" and "medium" let the device use faster passes (TF32 or
// bf16 on a GPU), as they let CUDA.
lowering::Builder::Precision float32_precision() {
  switch (at::globalContext().float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::HIGHEST: return lowering::Builder::Precision::Highest;
    case at::Float32MatmulPrecision::HIGH: return lowering::Builder::Precision::High;
    default: return lowering::Builder::Precision::Default;
  }
}

// ---- dtype mapping --------------------------------------------------------

at::ScalarType scalar_type_of(ElementType e) {
  switch (e) {
    case ElementType::Pred: return at::kBool;
    case ElementType::S8: return at::kChar;
    case ElementType::S16: return at::kShort;
    case ElementType::S32: return at::kInt;
    case ElementType::S64: return at::kLong;
    case ElementType::U8: return at::kByte;
    case ElementType::U16: return at::kUInt16;
    case ElementType::U32: return at::kUInt32;
    case ElementType::U64: return at::kUInt64;
    case ElementType::F16: return at::kHalf;
    case ElementType::BF16: return at::kBFloat16;
    case ElementType::F32: return at::kFloat;
    case ElementType::F64: return at::kDouble;
    case ElementType::C64: return at::kComplexFloat;
    case ElementType::C128: return at::kComplexDouble;
  }
  return at::kFloat;
}

std::optional<ElementType> element_of(at::ScalarType t) {
  switch (t) {
    case at::kBool: return ElementType::Pred;
    case at::kChar: return ElementType::S8;
    case at::kShort: return ElementType::S16;
    case at::kInt: return ElementType::S32;
    case at::kLong: return ElementType::S64;
    case at::kByte: return ElementType::U8;
    case at::kUInt16: return ElementType::U16;
    case at::kUInt32: return ElementType::U32;
    case at::kUInt64: return ElementType::U64;
    case at::kHalf: return ElementType::F16;
    case at::kBFloat16: return ElementType::BF16;
    case at::kFloat: return ElementType::F32;
    case at::kDouble: return ElementType::F64;
    case at::kComplexFloat: return ElementType::C64;
    case at::kComplexDouble: return ElementType::C128;
    default: return std::nullopt;
  }
}

ElementType element_or_throw(at::ScalarType t) {
  auto e = element_of(t);
  TORCH_CHECK(e, "tpu tensors do not support dtype ", t);
  return *e;
}
// What a storage holds for a program: its buffer's type, the type a recorded
// graph will give it (pending), or nothing (never written: zeros).
std::optional<lowering::TensorType> storage_type(const StorageState& st) {
  std::lock_guard<std::mutex> lock(storage_mutex());
  return storage_type_locked(st);
}
// storage_type(st) under the lock that also sees whether st lost its value (then it raises).
std::optional<lowering::TensorType> checked_storage_type(const StorageState& st) {
  {
    std::lock_guard<std::mutex> lock(storage_mutex());
    if (!st.lost) return storage_type_locked(st);
  }
  check_has_value(st);  // raises
  return std::nullopt;
}
std::optional<lowering::TensorType> storage_type_locked(const StorageState& st) {
  if (st.pending) return lowering::TensorType{st.pending_element, {st.pending_count}};
  if (st.buffer) return lowering::TensorType{st.buffer->element_type(), st.buffer->dims()};
  return std::nullopt;
}
namespace {
// storage_type_locked(st) == type, without building a TensorType (this runs for every recorded op).
bool has_type_locked(const StorageState& st, const std::optional<lowering::TensorType>& type) {
  if (st.pending)
    return type && type->element == st.pending_element && type->dims.size() == 1 && type->dims[0] == st.pending_count;
  if (st.buffer) return type && type->element == st.buffer->element_type() && type->dims == st.buffer->dims();
  return !type;
}
}  // namespace
bool storages_as_keyed(const Call& call) {
  for (const KeyedStorage& keyed : call.keyed_storages)
    if (!has_type_locked(*keyed.state, keyed.type)) return false;
  return true;
}
at::Tensor written_tensor(const Call& call, const std::vector<c10::IValue>& args, size_t k) {
  return item_tensor(args[call.written[k]], call.written_items[k]);
}
at::Tensor item_tensor(const c10::IValue& v, int item) {
  if (item < 0) return v.toTensor();
  if (v.isTensorList()) return v.toTensorList().get(item);
  auto opt = v.toList().get(item);
  return opt.isNone() ? at::Tensor() : opt.toTensor();
}
namespace {
std::string make_base_name(const c10::FunctionSchema& s) { return lowering::base_name_of(s.name()); }
}  // namespace

namespace {
// Bumped when an operator's schema goes away (a torch.library op destroyed): its
// address may come back with another schema, so every thread's last-schema entry is stale.
std::atomic<uint64_t> g_schema_epoch{0};
struct SchemaDeregistrations final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle&) override {}
  void onOperatorDeregistered(const c10::OperatorHandle&) override { ++g_schema_epoch; }
};
[[maybe_unused]] const bool g_schema_listener = [] {
  new c10::RegistrationHandleRAII(  // never removed: the listener lives as long as the dispatcher
      c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<SchemaDeregistrations>()));
  return true;
}();
}  // namespace

const SchemaFacts& schema_facts(const c10::FunctionSchema& s) {
  // The last schema asked, per thread: recording asks several times per op, and loops repeat one op.
  thread_local const c10::FunctionSchema* last = nullptr;
  thread_local const SchemaFacts* last_facts = nullptr;
  thread_local uint64_t last_epoch = 0;
  // Rules registered at runtime (register_lowering, the platform once known) renew every schema's facts.
  const uint64_t epoch = g_schema_epoch.load(std::memory_order_acquire) + lowering::rules_epoch();
  if (&s == last && epoch == last_epoch) return *last_facts;
  last = &s;
  last_epoch = epoch;
  // Built once per schema and thread: every recorded op asks. The entry is checked against the
  // schema's names, so a schema at a reused address (a torch.library op re-registered) gets its own.
  thread_local std::unordered_map<const c10::FunctionSchema*, SchemaFacts> cache;
  const std::string& base = s.name();
  const std::string& overload = s.overload_name();
  SchemaFacts& facts = cache[&s];
  last_facts = &facts;  // a node's address: stable while the map grows
  const std::string& name = facts.op_name;
  bool same = name.size() == base.size() + (overload.empty() ? 0 : overload.size() + 1) &&
              name.compare(0, base.size(), base) == 0 &&
              (overload.empty() || (name[base.size()] == '.' && name.compare(base.size() + 1, overload.size(), overload) == 0));
  if (same && facts.epoch == epoch) return facts;
  facts = SchemaFacts{};
  facts.epoch = epoch;
  facts.op_name = overload.empty() ? base : base + "." + overload;
  facts.base_name = make_base_name(s);
  facts.rule = lowering::find_rule(facts.base_name, overload, lowering::current_platform());
  facts.entry = facts.rule && facts.rule->fn ? facts.rule : nullptr;
  facts.is_copy = facts.base_name == "copy";
  facts.is_copy_ = base == "aten::copy_";
  facts.is_cat = facts.op_name == "aten::cat";
  facts.indices_at = s.argumentIndexWithName("indices");
  facts.self_at = s.argumentIndexWithName("self");
  for (const auto& arg : s.arguments()) {
    bool writes = arg.alias_info() && arg.alias_info()->isWrite();
    bool runtime_float = false;
    if (facts.entry) {
      for (const auto& name : facts.entry->extra_writes) writes = writes || arg.name() == name;
      for (const auto& name : facts.entry->runtime_floats) runtime_float = runtime_float || arg.name() == name;
    }
    facts.writes.push_back(writes);
    facts.runtime_float.push_back(runtime_float);
  }
  return facts;
}
const std::string& op_name(const c10::FunctionSchema& s) { return schema_facts(s).op_name; }
const std::string& base_name(const c10::FunctionSchema& s) { return schema_facts(s).base_name; }
bool has_cpu_rule(const c10::FunctionSchema& s, uint32_t bits) {
  const lowering::OpRule* rule = schema_facts(s).rule;
  return rule && (rule->cpu_rules & bits);
}

hlo::Location op_location(const c10::FunctionSchema& schema, graph::SourceLocation location) {
  auto [file, line] = graph::source_file_line(location);
  return {op_name(schema), std::move(file), line};
}

std::string describe_call(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  std::string text = op_name(schema) + "(";
  bool first = true;
  for (const c10::IValue& v : args) {
    map_tensors(v, [&](const at::Tensor& t) {
      if (t.defined()) {
        text += (first ? "" : ", ") + std::string(c10::toString(t.scalar_type())) + c10::str(t.sizes());
        first = false;
      }
      return t;
    });
  }
  return text + ")";
}

std::vector<std::string> non_default_arguments(const Call& call) {
  std::vector<std::string> names;
  const auto& arguments = call.schema.arguments();
  for (size_t i = 0; i < arguments.size() && i < call.args.size(); ++i) {
    const c10::TypePtr& type = arguments[i].type();
    bool tensor = type->kind() == c10::TypeKind::TensorType ||
                  (type->kind() == c10::TypeKind::OptionalType && type->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (tensor) continue;
    const c10::IValue& v = call.args[i];
    const auto& d = arguments[i].default_value();
    bool numbers = d && v.isScalar() && d->isScalar() && !v.isComplexDouble() && !d->isComplexDouble();
    bool same = d && (v.isNone() ? d->isNone() : numbers ? v.toScalar().toDouble() == d->toScalar().toDouble() : *d == v);
    if (!same) names.push_back(arguments[i].name());
  }
  return names;
}

}  // namespace torch_pjrt
