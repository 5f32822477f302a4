#include "aten/executor.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/BinaryOps.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/TypeProperties.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <tuple>
#include <mutex>
#include <set>
#include <unordered_map>

#include "aten/device.h"
#include "aten/exit_gate.h"
#include "aten/fused_graph.h"
#include "aten/op_call.h"
#include "aten/device_context.h"
#include "aten/profiling.h"
#include "aten/lowering.h"
#include "graph/metrics.h"
#include "graph/source_location.h"
#include "graph/strided_view.h"
#include "pjrt/error.h"

namespace torch_pjrt {

using graph::metrics;

namespace {

// `as_storage`: a storage's whole buffer, kept 1-D like every storage buffer
// (a program's storage parameter type then follows from the op signature).
pjrt::BufferPtr upload(const at::Tensor& cpu, int device, bool as_storage = false) {
  at::Tensor dense = cpu.contiguous();
  ElementType e = element_or_throw(dense.scalar_type());
  std::vector<int64_t> dims(dense.sizes().begin(), dense.sizes().end());
  if (as_storage) dims = {dense.numel()};
  metrics().host_to_device_bytes += static_cast<int64_t>(dense.nbytes());
  return client().buffer_from_host(dense.const_data_ptr(), e, dims, device);
}

// Host values of Scalar operands are few and repeat (alpha=1, lr, the 0-d
// CPU tensor PyTorch makes of `x + 1.0`): keep their device buffers instead of
// uploading one per op. `bytes` holds one element of type `e`.
pjrt::BufferPtr cached_scalar_buffer(const unsigned char (&bytes)[8], ElementType e, int device) {
  DeviceContext& ctx = device_context(device);
  auto& cache = ctx.scalar_buffers;
  std::string key(reinterpret_cast<const char*>(bytes), 8);
  key += static_cast<char>(e);
  std::lock_guard<std::mutex> lock(ctx.scalar_mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto buf = client().buffer_from_host(bytes, e, {}, device);
  metrics().host_to_device_bytes += static_cast<int64_t>(byte_size(e));
  if (cache.size() > 4096) cache.clear();
  cache.emplace(std::move(key), buf);
  return buf;
}

pjrt::BufferPtr scalar_buffer(const c10::Scalar& s, ElementType e, int device) {
  unsigned char bytes[8] = {0};
  switch (e) {
    case ElementType::Pred: bytes[0] = s.toBool(); break;
    case ElementType::S8: { int8_t v = s.toChar(); std::memcpy(bytes, &v, 1); break; }
    case ElementType::S16: { int16_t v = s.toShort(); std::memcpy(bytes, &v, 2); break; }
    case ElementType::S32: { int32_t v = s.toInt(); std::memcpy(bytes, &v, 4); break; }
    case ElementType::S64: { int64_t v = s.toLong(); std::memcpy(bytes, &v, 8); break; }
    case ElementType::U8: { uint8_t v = s.toByte(); std::memcpy(bytes, &v, 1); break; }
    case ElementType::U16: { uint16_t v = s.toUInt16(); std::memcpy(bytes, &v, 2); break; }
    case ElementType::U32: { uint32_t v = s.toUInt32(); std::memcpy(bytes, &v, 4); break; }
    case ElementType::U64: { uint64_t v = s.toUInt64(); std::memcpy(bytes, &v, 8); break; }
    case ElementType::F16: { at::Half v = s.toHalf(); std::memcpy(bytes, &v, 2); break; }
    case ElementType::BF16: { at::BFloat16 v = s.toBFloat16(); std::memcpy(bytes, &v, 2); break; }
    case ElementType::F32: { float v = s.toFloat(); std::memcpy(bytes, &v, 4); break; }
    case ElementType::F64: { double v = s.toDouble(); std::memcpy(bytes, &v, 8); break; }
    case ElementType::C64: { c10::complex<float> v = s.toComplexFloat(); std::memcpy(bytes, &v, 8); break; }
    case ElementType::C128: return upload(at::scalar_tensor(s, at::kComplexDouble), device);  // 16 bytes
  }
  return cached_scalar_buffer(bytes, e, device);
}

// A CPU tensor operand; 0-d ones go through the scalar cache.
pjrt::BufferPtr host_operand(const at::Tensor& t, int device) {
  ElementType e = element_or_throw(t.scalar_type());
  if (t.dim() != 0 || byte_size(e) > 8) return upload(t, device);
  unsigned char bytes[8] = {0};
  std::memcpy(bytes, t.const_data_ptr(), byte_size(e));
  return cached_scalar_buffer(bytes, e, device);
}

// ---- signatures -----------------------------------------------------------

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

  void num(int64_t v) {
    key += std::to_string(v);
    key += ',';
  }
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

// ---- meta inference -------------------------------------------------------

at::Tensor meta_like(const at::Tensor& t) {
  // Wrapped numbers (the `1` in `x + 1`) stay CPU scalars: meta kernels accept
  // them, and Python meta kernels turn them back into numbers.
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

c10::IValue meta_value(const c10::IValue& v) {
  // Factories name their device: on tpu the meta call would come back here.
  if (v.isDevice()) return c10::Device(at::kMeta);
  return map_tensors(v, meta_like);
}

bool is_written(const Call& call, int arg) {
  return std::find(call.written.begin(), call.written.end(), arg) != call.written.end();
}

std::vector<at::ScalarType> written_compute_dtypes(const Call& call, const std::vector<c10::IValue>& metas);
// PyTorch's meta kernels leave out some checks its CPU kernels make: on
// empty inputs (max() of an empty tensor, max(dim) over an empty dim) and on
// out= tensors of another dtype (bitwise_not(int, out=half), amax, tril). For
// such calls the CPU kernel runs once per signature on stand-ins of the same
// sizes and dtypes, so its error (type and message) is raised here.
bool meta_may_miss_an_error(const Call& call, int64_t* total) {
  bool any_empty = false, out_dtype_differs = false;
  std::set<at::ScalarType> input_dtypes;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto& v = call.args[i];
    if (v.isGenerator() && !v.isNone()) return false;
    bool written = is_written(call, static_cast<int>(i));
    map_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined()) return t;
      any_empty = any_empty || t.numel() == 0;
      *total += t.numel();
      if (!written && !t.unsafeGetTensorImpl()->is_wrapped_number()) input_dtypes.insert(t.scalar_type());
      return t;
    });
  }
  // out= (not in-place: self is not written) of a dtype no input has.
  if (call.returns_written && !call.schema.arguments().empty() && call.schema.arguments()[0].name() == "self" &&
      !is_written(call, 0)) {
    for (size_t k = 0; k < call.written.size(); ++k)
      out_dtype_differs = out_dtype_differs || !input_dtypes.count(written_tensor(call, call.args, k).scalar_type());
  }
  return any_empty || (out_dtype_differs && !input_dtypes.empty());
}
// The dtypes of the call's tensors (wrapped numbers aside); none if it draws
// from a generator (a probe would advance it).
std::optional<std::set<at::ScalarType>> tensor_dtypes(const Call& call) {
  std::set<at::ScalarType> dtypes;
  for (const auto& v : call.args) {
    if (v.isGenerator() && !v.isNone()) return std::nullopt;
    map_tensors(v, [&](const at::Tensor& t) {
      if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) dtypes.insert(t.scalar_type());
      return t;
    });
  }
  return dtypes;
}
void probe_on_cpu(const Call& call, bool only_dtype_errors = false);
void probe_on_cpu_with(const Call& call, bool only_dtype_errors, int fill);
void check_on_cpu_where_meta_may_not(const Call& call) {
  int64_t total = 0;
  bool may_miss = meta_may_miss_an_error(call, &total);
  if (may_miss && total <= (int64_t{1} << 22)) return probe_on_cpu(call);
  if (may_miss || total > (int64_t{1} << 20)) return;
  // Meta kernels do not check the dtypes a CPU kernel is built for (softmax,
  // gelu, avg_pool2d of integers), nor that it insists on one dtype where they
  // promote (torch.complex(float, double)): calls with integer or bool tensors,
  // or with tensors of several dtypes, probe the CPU kernel for that error only
  // (other errors of stand-ins are no verdict).
  auto dtypes = tensor_dtypes(call);
  if (!dtypes) return;
  bool integral = std::any_of(dtypes->begin(), dtypes->end(),
                              [](at::ScalarType t) { return at::isIntegralType(t, /*includeBool=*/true); });
  // Lowerings that follow CUDA for dtypes the CPU kernel lacks (histc of integers).
  static const std::set<std::string> cuda_dtypes{"histc"};
  if ((integral || dtypes->size() > 1) && !cuda_dtypes.count(base_name(call.schema))) probe_on_cpu(call, true);
}

// The op's meta kernel raised: the CPU kernel decides (its error, or its result).
struct MetaRejected {};

// Runs the op's meta kernel: PyTorch's own shape, dtype and error checks.
MetaResult infer_meta(const Call& call) {
  torch::jit::Stack stack;
  std::vector<c10::IValue> metas;
  for (const auto& v : call.args) {
    metas.push_back(meta_value(v));
    stack.push_back(metas.back());
  }
  // Before the op's own meta kernel, whose out= cast check is laxer than CPU's.
  std::vector<at::ScalarType> compute = written_compute_dtypes(call, metas);
  try {
    call.op.callBoxed(&stack);
  } catch (const c10::NotImplementedError&) {
    // An op that only writes its arguments (_fused_sgd_ has no meta kernel)
    // needs none: its outputs are those arguments. Its lowering checks them.
    if (!call.schema.returns().empty() || call.written.empty()) throw;
    stack.clear();
  } catch (const std::exception&) {
    // Many meta kernels are Python references whose errors differ from the
    // CPU kernel's (type, message) or that reject what the CPU accepts.
    throw MetaRejected();
  }
  MetaResult r;
  auto add = [&](const at::Tensor& t) {
    r.outputs.push_back(OutputMeta{element_or_throw(t.scalar_type()), lowering::Dims(t.sizes().begin(), t.sizes().end())});
    r.dtypes.push_back(t.scalar_type());
    r.absent.push_back(false);
    bool keep = !t.is_contiguous() && t.is_non_overlapping_and_dense();
    r.strides.push_back(keep ? t.strides().vec() : std::vector<int64_t>());
  };
  if (call.returns_written) {
    for (size_t k = 0; k < call.written.size(); ++k) add(written_tensor(call, metas, k));
    for (size_t i = 0; i < call.written.size(); ++i) r.return_counts.push_back(1);
    // The lowering computes in the op's own result dtype; emit() casts to the written dtype.
    for (size_t i = 0; i < compute.size(); ++i) r.outputs[i].element = element_or_throw(compute[i]);
    return r;
  }
  for (const auto& v : stack) {
    if (v.isTensor() && v.toTensor().defined()) {
      add(v.toTensor());
      r.return_counts.push_back(1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (const at::Tensor& t : list) add(t);
      r.return_counts.push_back(-static_cast<int>(list.size()) - 1);
    } else if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      // The lowering still yields a value here; the program leaves it out.
      r.outputs.push_back(OutputMeta{ElementType::F32, {}});
      r.dtypes.push_back(at::kFloat);
      r.absent.push_back(true);
      r.strides.emplace_back();
      r.return_counts.push_back(0);
    } else if (v.isInt()) {
      // A number the meta kernel derives from shapes (attention's max_q, max_k): fixed by the op's key.
      r.numbers.push_back(v.toInt());
      r.return_counts.push_back(kNumberReturn);
    } else {
      throw lowering::Unsupported("returns a non-tensor value");
    }
  }
  // Written arguments follow the returns: the lowering yields their new values.
  for (size_t k = 0; k < call.written.size(); ++k) add(written_tensor(call, metas, k));
  return r;
}

// ---- the lowering context over a real call --------------------------------

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
  static bool absent(const c10::IValue& v) { return v.isNone() || (v.isTensor() && !v.toTensor().defined()); }

  bool has(std::string_view name) const override {
    auto i = call_.schema.argumentIndexWithName(name);
    return i && !absent(call_.args[*i]);
  }

  bool is_tensor(std::string_view name) const override {
    auto i = call_.schema.argumentIndexWithName(name);
    return i && call_.args[*i].isTensor() && call_.args[*i].toTensor().defined();
  }

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

// ---- building and running ---------------------------------------------------
// out= tensors take the result's shape. A storage that grows is lowered at its
// new extent: the key saw the old one, and the same key always grows it alike.
at::Tensor resize_written(Call& call, const OutputPlan& p, c10::IntArrayRef sizes) {
  at::Tensor t = item_tensor(call.args[p.arg], p.item);
  if (t.sizes().equals(sizes)) return t;
  t.resize_(sizes);
  const StorageState* st = &storage_state(t.storage());
  if (KeyedStorage* keyed = find_keyed(call, st)) keyed->extent = extent_bytes(*st);
  return t;
}
void resize_outputs(Call& call, const std::vector<OutputPlan>& plans) {
  for (const auto& p : plans)
    if (p.write) resize_written(call, p, p.dims);
}

// ---- CPU checks the meta kernels miss ----------------------------------------

// Memory overlap, with ATen's own rules as the CPU kernels apply them
// (TensorIterator and the index family). tpu data pointers are storage + offset,
// so these metadata checks see what they see on the CPU.
void check_memory_overlap(const Call& call) {
  // CPU writes these without an internal-overlap error (a constant, or only a deprecation warning).
  static const std::set<std::string> internal_ok{"fill", "zero", "masked_fill", "index_fill", "index_put",
                                                 "_index_put_impl"};
  // CPU kernels that check no overlap between their output and inputs.
  static const std::set<std::string> inputs_unchecked{"fill", "masked_fill", "index_fill", "masked_scatter",
                                                      "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "sum", "mean"};
  // Kernels that reject even full aliasing (at::assert_no_overlap) of their output with every input: the
  // index family, index_select, cat (an out= the very tensor they read would be read while written).
  static const std::set<std::string> no_aliasing{"index_put", "_index_put_impl", "index_add", "index_copy",
                                                 "scatter", "scatter_add", "scatter_reduce", "index_reduce",
                                                 "index_select", "cat"};
  // ... or of their output with these inputs only (the others: partial overlap, as TensorIterator).
  static const std::map<std::string, std::set<std::string>> no_aliasing_with{{"gather", {"self"}}};
  std::string base = base_name(call.schema);
  auto only = no_aliasing_with.find(base);
  for (size_t k = 0; k < call.written.size(); ++k) {
    int w = call.written[k];
    const at::Tensor out = written_tensor(call, call.args, k);
    if (!internal_ok.count(base)) at::assert_no_internal_overlap(out);
    if (inputs_unchecked.count(base)) continue;
    for (size_t i = 0; i < call.args.size(); ++i) {
      if (static_cast<int>(i) == w) continue;
      map_tensors(call.args[i], [&](const at::Tensor& in) {
        if (!in.defined() || in.device().type() != kTpu) return in;
        if (no_aliasing.count(base) ||
            (only != no_aliasing_with.end() && only->second.count(call.schema.arguments()[i].name())))
          at::assert_no_overlap(out, in);
        else
          at::assert_no_partial_overlap(out, in);
        return in;
      });
    }
  }
}

// The CPU kernel checks the value broadcasts to the indexing result; the meta
// kernel does not (a mismatch would fail compiling the lowering instead).
void check_index_put_value_shape(const Call& call, const at::Tensor& self, const at::Tensor& values) {
  const auto& indices = call.args[*call.schema.argumentIndexWithName("indices")];
  bool by_mask = false;  // boolean masks select data-dependent counts: the kernel checks those
  map_tensors(indices, [&](const at::Tensor& t) {
    by_mask = by_mask || (t.defined() && (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte));
    return t;
  });
  if (by_mask) return;
  auto meta_indices = meta_value(indices).to<c10::List<std::optional<at::Tensor>>>();
  at::Tensor result;
  try {
    result = at::index(at::empty(self.sizes(), self.options().device(at::kMeta)), meta_indices);
  } catch (const std::exception&) {
    throw MetaRejected();  // indices that do not broadcast: the CPU kernel raises its own IndexError
  }
  TORCH_CHECK(at::is_expandable_to(values.sizes(), result.sizes()), "shape mismatch: value tensor of shape ",
              values.sizes(), " cannot be broadcast to indexing result of shape ", result.sizes());
}

// Checks CPU kernels make in their bodies, outside the meta functions.
void check_cpu_kernel_rules(const Call& call) {
  std::string base = base_name(call.schema);
  auto alpha = call.schema.argumentIndexWithName("alpha");
  if (alpha && (base == "add" || base == "sub" || base == "rsub") && call.args[*alpha].isScalar()) {
    // The references accept a float alpha with bool tensors; BinaryOps' alpha_check does not.
    const auto& self = call.args[*call.schema.argumentIndexWithName("self")];
    const auto& other = call.args[*call.schema.argumentIndexWithName("other")];
    at::ScalarType common = other.isTensor() ? at::result_type(self.toTensor(), other.toTensor())
                                             : at::result_type(self.toTensor(), other.toScalar());
    at::native::alpha_check(common, call.args[*alpha].toScalar());
  }
  if (base == "index_put" || base == "_index_put_impl") {
    auto self = call.args[*call.schema.argumentIndexWithName("self")].toTensor();
    auto values = call.args[*call.schema.argumentIndexWithName("values")].toTensor();
    // In the CPU kernel's order (make_index_put_iterator): indices, value shape, then dtype.
    check_index_put_value_shape(call, self, values);
    TORCH_CHECK(values.scalar_type() == self.scalar_type(),
                "Index put requires the source and destination dtypes match, got ", self.scalar_type(),
                " for the destination and ", values.scalar_type(), " for the source.");
  }
}

// Saved statistics of CPU's layer and batch norms: the meta kernels (modelled
// on CUDA) say float32 for half inputs; the CPU kernels save them in the
// parameters' dtype (float32 only when a weight, bias or running stat is), and
// batch norm in eval mode saves none (empty tensors).
void apply_cpu_norm_stats_rules(const Call& call, MetaResult& meta) {
  std::string base = base_name(call.schema);
  bool layer = base == "native_layer_norm", batch = base == "native_batch_norm";
  if ((!layer && !batch) || meta.outputs.size() < 3) return;
  at::ScalarType input = call.args[*call.schema.argumentIndexWithName("input")].toTensor().scalar_type();
  at::ScalarType stats = input;
  for (const char* name : {"weight", "bias", "running_mean", "running_var"}) {
    auto i = call.schema.argumentIndexWithName(name);
    if (i && call.args[*i].isTensor() && call.args[*i].toTensor().scalar_type() == at::kFloat) stats = at::kFloat;
  }
  bool eval_with_running = batch && !call.args[*call.schema.argumentIndexWithName("training")].toBool() &&
                           call.args[*call.schema.argumentIndexWithName("running_mean")].isTensor() &&
                           call.args[*call.schema.argumentIndexWithName("running_var")].isTensor();
  for (size_t i : {1, 2}) {
    if (input == at::kHalf || input == at::kBFloat16) {
      meta.dtypes[i] = stats;
      meta.outputs[i].element = element_or_throw(stats);
    }
    if (eval_with_running) {
      meta.outputs[i].dims = {0};
      meta.strides[i] = {};
    }
  }
}

// Output layouts CPU kernels choose where the meta kernels say row-major:
// convolutions (and their gradients) run channels_last when the input or the
// weight is (3-d convolutions in float64 have no channels_last kernel).
void apply_cpu_layout_rules(const Call& call, MetaResult& meta) {
  std::string base = base_name(call.schema);
  // Pooling kernels (and their gradients) follow the input's suggested memory format.
  static const std::set<std::string> pools{"max_pool2d_with_indices", "max_pool3d_with_indices",
                                           "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"};
  bool pool = pools.count(base) > 0;
  if (base != "convolution" && base != "convolution_backward" && !pool) return;
  auto input = call.args[*call.schema.argumentIndexWithName(pool ? "self" : "input")].toTensor();
  // 3-d pools see an unbatched (C, D, H, W) input as a batch of one.
  bool unbatched = pool && base.rfind("max_pool3d", 0) == 0 && input.dim() == 4;
  if (unbatched) input = input.unsqueeze(0);
  auto weight = pool ? input : call.args[*call.schema.argumentIndexWithName("weight")].toTensor();
  auto suggests = [&](c10::MemoryFormat f) {
    return input.suggest_memory_format() == f || weight.suggest_memory_format() == f;
  };
  bool cl2 = input.dim() == 4 && suggests(c10::MemoryFormat::ChannelsLast);
  bool cl3 = input.dim() == 5 && suggests(c10::MemoryFormat::ChannelsLast3d) && (pool || input.scalar_type() != at::kDouble);
  // (the batch of one's stride defeats suggest_memory_format; CPU's kernel asks is_contiguous)
  cl3 = cl3 || (unbatched && input.is_contiguous(c10::MemoryFormat::ChannelsLast3d));
  if (!cl2 && !cl3) return;
  for (size_t i = 0; i < meta.outputs.size(); ++i) {
    lowering::Dims dims = meta.outputs[i].dims;
    if (unbatched) dims.insert(dims.begin(), 1);
    if (meta.absent[i] || static_cast<int64_t>(dims.size()) != input.dim()) continue;
    std::vector<int64_t> strides = cl2 ? c10::get_channels_last_strides_2d(dims) : c10::get_channels_last_strides_3d(dims);
    if (unbatched) {
      dims.erase(dims.begin());
      strides.erase(strides.begin());
    }
    bool row_major = at::empty_strided(dims, strides, at::TensorOptions().device(at::kMeta)).is_contiguous();
    meta.strides[i] = row_major ? std::vector<int64_t>() : strides;
  }
}

// The functional form of an in-place or out= op (add_.Tensor, add.out ->
// add.Tensor): the overload of the base name whose arguments are the op's
// own minus the written out= ones. Its result dtype is what CPU computes in.
std::optional<c10::OperatorHandle> functional_form(const c10::FunctionSchema& schema) {
  static std::mutex mutex;
  static auto& found = *new std::unordered_map<std::string, std::optional<c10::OperatorHandle>>();
  static auto& overloads = *new std::unordered_map<std::string, std::vector<c10::OperatorName>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::string key = op_name(schema);
  if (auto it = found.find(key); it != found.end()) return it->second;
  auto& dispatcher = c10::Dispatcher::singleton();
  if (overloads.empty())
    for (const c10::OperatorName& n : dispatcher.getAllOpNames()) overloads[n.name].push_back(n);
  std::vector<const c10::Argument*> wanted;
  for (const auto& a : schema.arguments())
    if (!(a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite())) wanted.push_back(&a);
  std::string name = schema.name();
  if (name.size() > 1 && name.back() == '_') name.pop_back();
  std::optional<c10::OperatorHandle> result;
  for (const c10::OperatorName& n : overloads[name]) {
    auto op = dispatcher.findOp(n);
    if (!op || !op->hasSchema() || op_name(op->schema()) == key || !op->schema().returns().size()) continue;
    const auto& args = op->schema().arguments();
    bool same = args.size() == wanted.size();
    for (size_t i = 0; same && i < args.size(); ++i)
      same = args[i].name() == wanted[i]->name() && args[i].type()->str() == wanted[i]->type()->str() &&
             !(args[i].alias_info() && args[i].alias_info()->isWrite());
    if (same) {
      result = op;
      break;
    }
  }
  found.emplace(key, result);
  return result;
}

// Runs the op's CPU kernel once on stand-ins of the same sizes and dtypes, so
// a check CPU makes outside the meta kernels raises CPU's own error (type and
// message). Stand-ins are ones (valid divisors; read-only inputs are expanded
// scalars, so no memory) and zeros for index arguments (valid for any size).
void probe_on_cpu(const Call& call, bool only_dtype_errors) { probe_on_cpu_with(call, only_dtype_errors, 1); }
void probe_on_cpu_with(const Call& call, bool only_dtype_errors, int fill) {
  torch::jit::Stack stack;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto& v = call.args[i];
    if (v.isDevice()) {
      stack.push_back(c10::Device(at::kCPU));
      continue;
    }
    bool written = is_written(call, static_cast<int>(i));
    bool index = call.schema.arguments()[i].name().find("ind") != std::string::npos;
    stack.push_back(map_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
      auto options = t.options().device(at::kCPU);
      at::Tensor one = index || fill == 0 ? at::zeros({}, options) : at::ones({}, options);
      // Dense tensors keep their strides (kernels such as _grouped_mm check
      // them); other views read an expanded scalar, which costs no memory.
      if (t.is_non_overlapping_and_dense()) return at::empty_strided(t.sizes(), t.strides(), options).copy_(one);
      return written ? one.expand(t.sizes()).clone() : one.expand(t.sizes());
    }));
  }
  try {
    call.op.callBoxed(&stack);
  } catch (const c10::NotImplementedError& e) {
    // No CPU kernel to ask: the meta kernel's checks are all there are. (A
    // kernel without this dtype raises as the CPU does.)
    if (std::string(e.what()).find("Could not run") == std::string::npos) throw;
  } catch (const std::exception& e) {
    if (!only_dtype_errors || fill == 0) throw;
    // Stand-in values may cause an error real data would not; one that ones
    // and zeros both raise with the same message is about the dtypes or
    // shapes ("Boolean inputs not supported for relu"): the CPU raises it.
    auto message = [](const std::exception& x) -> std::string {
      auto* c10_error = dynamic_cast<const c10::Error*>(&x);
      return c10_error ? c10_error->what_without_backtrace() : x.what();
    };
    std::string first = message(e);
    try {
      probe_on_cpu_with(call, false, 0);
    } catch (const std::exception& again) {
      if (first == message(again)) throw;
    }
  }
}

// In-place and out= ops compute in their functional form's result dtype and
// cast to the written tensor's dtype where CPU allows that cast. Returns the
// compute dtype per written tensor (in call.written order).
std::vector<at::ScalarType> written_compute_dtypes(const Call& call, const std::vector<c10::IValue>& metas) {
  std::vector<at::ScalarType> out;
  for (size_t k = 0; k < call.written.size(); ++k) out.push_back(written_tensor(call, metas, k).scalar_type());
  if (!call.returns_written) return out;
  auto functional = functional_form(call.schema);
  if (!functional) return out;
  torch::jit::Stack stack;
  const auto& args = call.schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (!(args[i].kwarg_only() && args[i].alias_info() && args[i].alias_info()->isWrite()))
      stack.push_back(meta_value(call.args[i]));
  try {
    functional->callBoxed(&stack);
  } catch (const c10::NotImplementedError&) {
    return out;  // no usable functional meta: the written dtype stays the compute dtype
  } catch (const std::exception&) {
    throw MetaRejected();
  }
  if (stack.size() != out.size()) return out;
  bool probe = false;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!stack[k].isTensor()) return out;
    at::ScalarType result = stack[k].toTensor().scalar_type();
    if (result == out[k]) continue;
    TORCH_CHECK(c10::canCast(result, out[k]), "result type ", result, " can't be cast to the desired output type ",
                out[k]);
    probe = true;
    out[k] = result;
  }
  if (probe) probe_on_cpu(call);
  return out;
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

// The 1-d factories' CPU kernels resize their out= tensor only when its element count differs
// (arange_out, range_out, linspace_out, logspace_out); otherwise the values fill it in its own shape,
// row-major, whatever its strides (od.t(), od[::2]). The meta kernels resize it to 1-d.
bool keeps_out_shape(const Call& call, const OutputPlan& p) {
  static const std::set<std::string> flat_factories{"arange", "range", "linspace", "logspace"};
  if (!flat_factories.count(base_name(call.schema))) return false;
  at::Tensor out = item_tensor(call.args[p.arg], p.item);
  return !out.sizes().equals(p.dims) && out.numel() == c10::multiply_integers(p.dims);
}

// The op's plan: PyTorch's meta kernel decides output shapes and dtypes.
std::shared_ptr<CachedOp> plan(Call& call, const lowering::LoweringEntry& entry) {
  check_memory_overlap(call);
  check_cpu_kernel_rules(call);
  auto cached = std::make_shared<CachedOp>();
  check_on_cpu_where_meta_may_not(call);
  cached->meta = infer_meta(call);
  cached->float32_precision = float32_precision();
  apply_cpu_layout_rules(call, cached->meta);
  apply_cpu_norm_stats_rules(call, cached->meta);
  cached->entry = &entry;
  // A lowering that does not declare complex support never computes a complex
  // result (real inputs, complex outputs: _to_copy, a factory with a dtype).
  for (const OutputMeta& o : cached->meta.outputs)
    if (is_complex(o.element) && !entry.complex) cached->unsupported = "no complex lowering";
  const MetaResult& meta = cached->meta;
  cached->return_counts = meta.return_counts;
  cached->cat = op_name(call.schema) == "aten::cat";
  size_t first_written = meta.outputs.size() - call.written.size();
  for (size_t i = 0; i < meta.outputs.size(); ++i) {
    OutputPlan p;
    p.absent = meta.absent[i];
    p.write = i >= first_written;
    p.arg = p.write ? call.written[i - first_written] : 0;
    p.item = p.write ? call.written_items[i - first_written] : -1;
    p.dtype = meta.dtypes[i];
    p.dims = meta.outputs[i].dims;
    if (p.write && keeps_out_shape(call, p)) p.dims = item_tensor(call.args[p.arg], p.item).sizes().vec();
    if (!p.write) p.strides = meta.strides[i];
    cached->outputs.push_back(p);
  }
  cached->outputs_empty = true;
  for (const OutputPlan& p : cached->outputs)
    if (!p.absent && c10::multiply_integers(p.dims) != 0) cached->outputs_empty = false;
  return cached;
}

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
void note_op_recompile(const std::string& name, const std::string& description, graph::SourceLocation location) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, graph::SourceLocation>, std::string> last;  // -> last description
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, first] = last.try_emplace({name, location}, description);
  if (first) return;
  std::string reason = name + " at " + graph::describe_source_location(location) + " recompiled: " + description +
                       " where the previous compile had " + it->second;
  if (it->second == description) reason += " (same shapes and dtypes: strides, storage offset, aliasing or other arguments differ)";
  graph::note_recompile_reason(std::move(reason));
  it->second = description;
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

// Strict and debug modes: the op as a program of its own.
void compile_alone(Call& call, CachedOp& cached, graph::SourceLocation location) {
  std::string description = describe_call(call.schema, call.args);
  note_op_recompile(op_name(call.schema), description, location);
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

// ---- debug-mode checks ----

// Debug mode with TORCH_PJRT_CHECK_NANS=1: a NaN or Inf in a floating-point
// result raises at the op that made it.
void check_finite(const Call& call, const std::vector<at::Tensor>& outs) {
  static const bool enabled = [] {
    const char* env = std::getenv("TORCH_PJRT_CHECK_NANS");
    return env && std::string(env) == "1";
  }();
  if (!enabled) return;
  for (const at::Tensor& t : outs) {
    if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) continue;
    TORCH_CHECK(at::isfinite(to_host(t)).all().item<bool>(), op_name(call.schema),
                " produced NaN or Inf (TORCH_PJRT_CHECK_NANS=1 checks every result in debug mode)");
  }
}

// The birth of the oldest storage with a value among `outs` (UINT64_MAX: none).
uint64_t oldest_born(const std::vector<at::Tensor>& outs) {
  uint64_t oldest = UINT64_MAX;
  std::lock_guard<std::mutex> lock(storage_mutex());
  for (const at::Tensor& t : outs) {
    if (!t.defined()) continue;
    const StorageState& st = storage_state(t.storage());
    if (st.buffer) oldest = std::min(oldest, st.born);
  }
  return oldest;
}

// Strict and debug modes: runs the op's own program now (asynchronously).
// Returns false (nothing run) when another thread changed an operand storage's
// type since the signature was taken: the caller plans the op again.
bool execute(Call& call, const CachedOp& cached, torch::jit::Stack* stack, size_t nargs) {
  std::vector<at::Tensor> outs = output_tensors(call, cached);
  std::vector<pjrt::BufferPtr> holders(cached.operands.size());
  for (size_t i = 0; i < holders.size(); ++i)  // uploads and RNG draws need no lock
    if (cached.operands[i].kind != OperandRef::Storage) holders[i] = operand_buffer(call, cached.operands[i]);
  pjrt::ExecutablePtr exe = cached.program->executable();  // loaded again if unloaded, before the lock
  // May wait for earlier programs: before the lock.
  const uint64_t dropped_before = checks_unread(call.device) ? writes_dropped_before(call.device, oldest_born(outs)) : 0;
  pjrt::LoadedExecutable::Result result;
  std::vector<pjrt::BufferPtr> replaced;  // old buffers, released after the lock
  ProfileScope profile([&] { return std::pair{"torch_pjrt::execute(" + op_name(call.schema) + ")", op_name(call.schema)}; });
  uint64_t program = 0;
  {
    // One step for every other thread: read the operands, enqueue, install.
    std::lock_guard<std::mutex> lock(storage_mutex());
    if (!storages_as_keyed(call)) return false;
    std::vector<pjrt::Buffer*> buffers;
    for (size_t i = 0; i < holders.size(); ++i) {
      if (cached.operands[i].kind == OperandRef::Storage) holders[i] = operand_buffer(call, cached.operands[i]);
      buffers.push_back(holders[i].get());
    }
    result = exe->execute(buffers);
    program = begin_program(call.device);
    size_t produced = 0;
    for (const at::Tensor& t : outs) {
      if (!t.defined()) continue;
      StorageState& st = storage_state(t.storage());
      pjrt::BufferPtr& out = result.outputs[produced++];
      if (st.buffer && st.born < dropped_before) continue;  // a check failed before: keep its value
      if (!st.buffer) st.born = program;
      replaced.push_back(std::exchange(st.buffer, out));
      st.lost.reset();
    }
  }
  if (cached.checks)
    defer_checks(call.device, program, result.outputs.back(), cached.checks, {graph::capture_source_location()});
  ++metrics().executions;
  graph::count_lowered_op(op_name(call.schema));
  if (profile.active() && result.done) result.done->wait();
  track(call.device, std::move(result.done), std::move(exe));
  if (mode() == Mode::Debug) raise_failed_checks(call.device);  // debug waited for the program: raise at the op
  if (mode() == Mode::Debug) check_finite(call, outs);
  push_returns(stack, nargs, cached, outs);
  return true;
}

// A call reaches the device only with a tpu tensor in it; a CPU tensor it
// would write (out=) is the user's device mix-up, as on CUDA. (PyTorch's CPU
// fallback would instead fail copying its result back.)
void check_written_on_device(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  size_t nargs = schema.arguments().size();
  for (size_t i = 0; i < nargs; ++i) {
    const auto& arg = schema.arguments()[i];
    if (!arg.alias_info() || !arg.alias_info()->isWrite()) continue;
    map_tensors(stack[stack.size() - nargs + i], [&](const at::Tensor& t) {
      TORCH_CHECK(!t.defined() || t.device().type() == kTpu, "Expected all tensors to be on the same device, but ",
                  "found at least two devices, tpu:", current_device(), " and ", t.device(), "! (in ",
                  op_name(schema), ", argument '", arg.name(), "')");
      return t;
    });
  }
}
// Whether a tensor the op writes shares its storage with another tensor argument (put_(idx, self[:3]),
// take(a, i, out=a)). PyTorch's CPU fallback copies each argument on its own, so the CPU kernel would see
// no aliasing: neither its overlap errors nor its results with aliased arguments.
bool written_shares_storage(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  size_t nargs = schema.arguments().size();
  std::vector<std::pair<const c10::StorageImpl*, bool>> seen;  // storage, written
  bool plain = true;  // conjugate/negative views would need their bits carried over: left to PyTorch's fallback
  for (size_t i = 0; i < nargs; ++i) {
    const auto& info = schema.arguments()[i].alias_info();
    bool written = info && info->isWrite();
    map_tensors(stack[stack.size() - nargs + i], [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kTpu) return t;
      plain = plain && !t.is_conj() && !t.is_neg();
      seen.emplace_back(t.storage().unsafeGetStorageImpl(), written);
      return t;
    });
  }
  if (!plain) return false;
  for (size_t a = 0; a < seen.size(); ++a)
    for (size_t b = a + 1; b < seen.size(); ++b)
      if (seen[a].first == seen[b].first && (seen[a].second || seen[b].second)) return true;
  return false;
}

// The CPU fallback for such calls: each tpu storage is copied to the host once and every argument becomes a
// host view of its copy with the same sizes, strides and offset, so the CPU kernel sees the aliasing as it is.
// Written arguments get their host views' values back; returns that alias an argument are that argument.
void cpu_fallback_aliased(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  size_t nargs = schema.arguments().size();
  std::unordered_map<const c10::StorageImpl*, at::Tensor> host;  // storage -> its bytes on the host
  std::vector<c10::IValue> originals(stack->end() - nargs, stack->end());
  std::optional<c10::Device> device;
  auto to_host = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().type() != kTpu) return t;
    device = t.device();
    const c10::Storage& storage = t.storage();
    auto it = host.find(storage.unsafeGetStorageImpl());
    if (it == host.end()) {
      int64_t nbytes = static_cast<int64_t>(storage.nbytes());
      at::Tensor bytes = at::empty({0}, t.options().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
      it = host.emplace(storage.unsafeGetStorageImpl(), bytes.cpu()).first;
    }
    return at::empty({0}, t.options().device(at::kCPU))
        .set_(it->second.storage(), t.storage_offset(), t.sizes(), t.strides());
  };
  std::vector<c10::IValue> on_host;
  for (const c10::IValue& v : originals) on_host.push_back(map_tensors(v, to_host));
  torch::jit::Stack cpu_stack(on_host.begin(), on_host.end());
  op.callBoxed(&cpu_stack);
  // Written arguments, in argument order (an out= resized by the CPU kernel takes its new shape).
  for (size_t i = 0; i < nargs; ++i) {
    const auto& info = schema.arguments()[i].alias_info();
    if (!info || !info->isWrite()) continue;
    std::vector<at::Tensor> dev, cpu;
    map_tensors(originals[i], [&](const at::Tensor& t) { dev.push_back(t); return t; });
    map_tensors(on_host[i], [&](const at::Tensor& t) { cpu.push_back(t); return t; });
    for (size_t k = 0; k < dev.size(); ++k) {
      if (!dev[k].defined() || dev[k].device().type() != kTpu) continue;
      if (!dev[k].sizes().equals(cpu[k].sizes())) dev[k].resize_(cpu[k].sizes());
      dev[k].copy_(cpu[k]);
    }
  }
  const auto& returns = schema.returns();
  std::vector<c10::IValue> results;
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto& info = returns[r].alias_info();
    std::optional<size_t> same;
    for (size_t i = 0; info && i < nargs && !same; ++i) {
      const auto& arg = schema.arguments()[i].alias_info();
      if (arg && arg->beforeSets() == info->beforeSets()) same = i;
    }
    if (same) {
      results.push_back(originals[*same]);
    } else {
      results.push_back(map_tensors(cpu_stack[r], [&](const at::Tensor& t) {
        return t.defined() && t.device().is_cpu() && device ? t.to(*device) : t;
      }));
    }
  }
  torch::jit::drop(*stack, nargs);
  for (auto& v : results) stack->push_back(std::move(v));
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  check_written_on_device(op.schema(), *stack);
  flush_pending();
  if (written_shares_storage(op.schema(), *stack)) cpu_fallback_aliased(op, stack);
  else at::native::cpu_fallback(op, stack);
  // Counted once it ran: when the CPU kernel raises (a shape error the meta
  // kernel saw first), that is the user's error, not an op running on the CPU.
  note_cpu_fallback(op_name(op.schema()), why);
}

// `copy_` of a view onto the very same view (`x[i] += 1` assigns x[i] back
// to itself) changes nothing: PyTorch's copy_ returns early there too. Running
// it would cost a whole-storage update per row in a fused graph.
bool is_self_copy(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  if (!schema_facts(schema).is_copy_) return false;
  const c10::IValue& dst = stack[stack.size() - 3];
  const c10::IValue& src = stack[stack.size() - 2];
  if (!dst.isTensor() || !src.isTensor()) return false;
  const at::Tensor& d = dst.toTensor();
  const at::Tensor& s = src.toTensor();
  return d.defined() && s.defined() && d.device() == s.device() && d.device().type() == kTpu &&
         d.is_alias_of(s) && d.scalar_type() == s.scalar_type() && d.sizes().equals(s.sizes()) &&
         d.strides().equals(s.strides()) && d.storage_offset() == s.storage_offset() && d.is_conj() == s.is_conj() &&
         d.is_neg() == s.is_neg();
}

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

// Boolean masks in an index list (x[mask], x[mask] = v) select a
// data-dependent count: each mask becomes its nonzero() columns, as ATen's
// expandTensors does. nonzero runs on the device and reads back only the
// count (_data_dependent.py), so the gather or scatter itself is lowered.
void expand_boolean_masks(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const SchemaFacts& facts = schema_facts(schema);
  auto indices_at = facts.indices_at, self_at = facts.self_at;
  if (!indices_at || !self_at) return;
  size_t base = stack->size() - schema.arguments().size();
  c10::IValue& indices = (*stack)[base + *indices_at];
  const c10::IValue& self_value = (*stack)[base + *self_at];
  if (!indices.isList() || indices.isTensorList() || !self_value.isTensor()) return;
  auto list = indices.toList();
  bool any = false;
  for (size_t i = 0; i < list.size(); ++i) {
    auto item = list.get(i);
    if (item.isNone()) continue;
    const at::Tensor& t = item.toTensor();
    if (t.defined() && (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte)) {
      if (t.dim() == 0) return;  // x[True] adds a dimension: left to the CPU
      any = true;
    }
  }
  if (!any) return;
  const at::Tensor self = self_value.toTensor();
  c10::List<std::optional<at::Tensor>> expanded;
  int64_t dim = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    auto item = list.get(i);
    at::Tensor t = item.isNone() ? at::Tensor() : item.toTensor();
    if (!t.defined() || (t.scalar_type() != at::kBool && t.scalar_type() != at::kByte)) {
      expanded.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
      ++dim;
      continue;
    }
    for (int64_t j = 0; j < t.dim(); ++j)
      TORCH_CHECK_INDEX(dim + j < self.dim() && t.size(j) == self.size(dim + j), "The shape of the mask ", t.sizes(),
                        " at index ", j, " does not match the shape of the indexed tensor ", self.sizes(), " at index ",
                        dim + j);
    if (t.scalar_type() == at::kByte)
      TORCH_WARN("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.");
    at::Tensor columns = at::nonzero(t);
    for (int64_t j = 0; j < t.dim(); ++j) expanded.push_back(columns.select(1, j));
    dim += t.dim();
  }
  indices = expanded;
}

// Index tensors held on the host (`x[cpu_indices]`) are checked at the op,
// with the CPU's error; indices on the device are checked by the program,
// whose verdict surfaces at the next wait (Runtime checks, architecture.md).
void check_host_indices(const Call& call) {
  const std::string& base = base_name(call.schema);
  if (base != "index" && base != "index_put" && base != "_index_put_impl") return;
  const auto& list = call.args[*call.schema.argumentIndexWithName("indices")];
  const at::Tensor& self = call.args[*call.schema.argumentIndexWithName("self")].toTensor();
  if (!list.isList()) return;
  auto items = list.toList();
  int64_t position = -1;  // CPU's message numbers the indexed dims only
  for (size_t d = 0; d < items.size() && static_cast<int64_t>(d) < self.dim(); ++d) {
    c10::IValue item = items.get(d);
    if (!item.isTensor() || !item.toTensor().defined()) continue;
    ++position;
    const at::Tensor& t = item.toTensor();
    if (!t.device().is_cpu() || t.numel() == 0 || !at::isIntegralType(t.scalar_type(), false)) continue;
    int64_t size = self.size(static_cast<int64_t>(d));
    at::Tensor flat = t.reshape(-1).to(at::kLong);
    at::Tensor bad = at::logical_or(flat < -size, flat >= size).nonzero();
    if (bad.numel() == 0) continue;
    TORCH_CHECK_INDEX(false, "index ", flat[bad[0][0].item<int64_t>()].item<int64_t>(), " is out of bounds for dimension ",
                      position, " with size ", size);
  }
}

// Returns false (stack untouched) when the op must run elsewhere.
bool run_lowered(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::string* why) {
  const auto& schema = op.schema();
  expand_boolean_masks(schema, stack);
  if (is_self_copy(schema, *stack)) {
    at::Tensor self = (*stack)[stack->size() - 3].toTensor();
    torch::jit::drop(*stack, 3);
    stack->push_back(self);
    return true;
  }
  const SchemaFacts& facts = schema_facts(schema);
  const lowering::LoweringEntry* entry = facts.entry;
  if (!entry) {
    *why = "no lowering";
    return false;
  }
  size_t nargs = schema.arguments().size();
  Call call{op, schema, std::vector<c10::IValue>(stack->end() - nargs, stack->end()), {}, false, -1};
  for (size_t i = 0; i < nargs; ++i) {
    if (!facts.writes[i] || CallContext::absent(call.args[i])) continue;
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
  call.returns_written = !schema.returns().empty();
  for (const auto& r : schema.returns()) call.returns_written = call.returns_written && r.alias_info();
  KeyBuilder kb;
  kb.allow_host = facts.is_copy;
  kb.key = facts.op_name;
  // Global state meta kernels read: the default dtype (int / int, factories
  // without a dtype, Python floats with integer tensors; the default complex
  // dtype follows it).
  kb.key += static_cast<char>('a' + static_cast<int>(at::get_default_dtype_as_scalartype()));
  // torch.set_float32_matmul_precision: how float32 dots and convolutions compute (never
  // in an elementwise lowering; reading it is a hash lookup per op).
  kb.key += entry->elementwise ? '-' : static_cast<char>('0' + static_cast<int>(float32_precision()));
  const FlatCat flat = flat_cat_of(call);
  const int64_t elementwise_capacity = flat.capacity > 0 ? 0 : capacity_elementwise_of(call, *entry);
  const RuntimeLength length =
      flat.capacity > 0 || elementwise_capacity > 0 ? RuntimeLength{} : runtime_length_of(call, *entry);
  if (flat.capacity > 0) {
    kb.shapeless = true;
    kb.key += "flat";
    kb.num(flat.capacity);
    kb.num(flat.rows);  // sizes stay out of the key, the lowering depends on the row count
  } else if (elementwise_capacity > 0) {
    kb.shapeless = true;  // every tensor is 0-d or of one shape, whole buffers of this capacity
    kb.key += "cap";
    kb.num(elementwise_capacity);
  } else if (length.length > 0) {
    kb.runtime_length = length.length;
    kb.key += "len";
    kb.num(length.bound);
  }
  kb.key += '#';
  for (size_t i = 0; i < nargs; ++i) {
    if (call.args[i].isDouble() && facts.runtime_float[i]) {
      kb.key += 'f';  // a runtime operand (Context::scalar): its value is no part of the key
      continue;
    }
    if (length.length > 0 && length.arg < 0 &&
        (schema.arguments()[i].name() == "end" || schema.arguments()[i].name() == "start")) {
      kb.key += 'e';  // arange's length (its result is made per call, its program computes the bound) and start
      continue;
    }
    kb.value(call.args[i], schema.arguments()[i], entry->bake_scalars, call);
    if (!kb.supported) {
      *why = kb.why;
      return false;
    }
  }
  if (call.device < 0) {  // a factory: its device argument (torch.arange(n, device="tpu:1")), else the current one
    for (const c10::IValue& v : call.args)
      if (v.isDevice() && v.toDevice().type() == kTpu && v.toDevice().has_index()) call.device = v.toDevice().index();
    if (call.device < 0) call.device = current_device();
  }
  check_host_indices(call);
  if (kb.complex && !entry->complex) {
    *why = "no complex lowering";
    return false;
  }

  DeviceContext& ctx = device_context(call.device);  // plans hold programs compiled for this device
  std::shared_ptr<CachedOp> cached;
  {
    std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
    auto it = ctx.op_cache.find(kb.key);
    if (it != ctx.op_cache.end()) cached = it->second;
  }
  if (cached && cached->exact_length > 0 && cached->exact_length != length.length) cached = nullptr;  // plan again
  if (cached) {
    ++metrics().op_cache_hits;
    if (kb.shared_storage && kb.runtime_offset && !call.written.empty()) check_memory_overlap(call);
  } else {
    ++metrics().op_cache_misses;
    try {
      cached = plan(call, *entry);
      cached->meta.flat_capacity = flat.capacity;
      cached->meta.flat_rows = flat.rows;
      if (elementwise_capacity > 0) {
        cached->meta.capacity = elementwise_capacity;
        for (OutputMeta& o : cached->meta.outputs) o.dims = {elementwise_capacity};
      }
      if (length.length > 0) plan_runtime_length(call, *cached, length);
    } catch (const lowering::Unsupported& e) {
      *why = e.what();
      return false;
    } catch (const c10::NotImplementedError& e) {
      *why = "no meta kernel";
      return false;
    } catch (const MetaRejected&) {
      *why = "its meta kernel rejects these arguments";
      return false;
    }
    std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
    ctx.op_cache.insert_or_assign(kb.key, cached);
  }
  // Planned for its length only: a fused graph's signature holds it.
  if (cached->exact_length > 0) kb.num(cached->exact_length);
  if (!cached->unsupported.empty()) {
    *why = cached->unsupported;
    return false;
  }
  if (cached->meta.capacity > 0) adopt_capacity(call, cached->meta.capacity);  // written tensors keep their sizes
  else if (cached->meta.length_bound > 0) resize_padded_outputs(call, *cached);
  else resize_outputs(call, cached->outputs);
  if (cached->outputs_empty) {  // XLA rejects some zero-sized windows and gathers
    push_returns(stack, nargs, *cached, output_tensors(call, *cached));
    return true;
  }
  bool fused = mode() == Mode::Fused || mode() == Mode::Lazy;
  // The user's line for a recompile note: taken before the lock, as it takes the GIL.
  graph::SourceLocation location = !fused && !cached->program ? graph::capture_source_location() : 0;
  try {
    std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
    if (fused && !cached->operands_known) learn_operands(call, *cached);
    if (!fused && !cached->program) compile_alone(call, *cached, location);
  } catch (const lowering::Unsupported& e) {
    cached->unsupported = e.what();
  } catch (const pjrt::Error& e) {
    cached->unsupported = std::string("lowering failed: ") + e.what();
  }
  if (!cached->unsupported.empty()) {
    *why = cached->unsupported;
    return false;
  }
  bool ran = fused ? record(call, cached, stack, nargs, std::move(kb.key)) : execute(call, *cached, stack, nargs);
  if (!ran) return run_lowered(op, stack, why);  // another thread changed a storage meanwhile: plan again
  return true;
}

c10::OperatorHandle find_op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

void run_or_throw(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::string why;
  if (!run_lowered(op, stack, &why)) cpu_fallback(op, stack, why);
}

}  // namespace

// Everything below is declared in a header: op_call.h (shared with fused
// graphs), executor.h and device.h.

// ---- dtype mapping --------------------------------------------------------

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
std::string make_base_name(const c10::FunctionSchema& s) {
  std::string name = s.name();
  if (name.rfind("aten::", 0) == 0) name = name.substr(6);
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_') name.pop_back();
  return name;
}
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
  const uint64_t epoch = g_schema_epoch.load(std::memory_order_acquire);
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
  if (same) return facts;
  facts = SchemaFacts{};
  facts.op_name = overload.empty() ? base : base + "." + overload;
  facts.base_name = make_base_name(s);
  facts.entry = lowering::find_lowering(facts.base_name);
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

hlo::Location op_location(const c10::FunctionSchema& schema, graph::SourceLocation location) {
  auto [file, line] = graph::source_file_line(location);
  return {op_name(schema), std::move(file), line};
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
// A buffer for an operand that is not a storage: a CPU tensor, a Scalar, or
// a fresh RNG state (drawn now, so every mode sees the same stream).
pjrt::BufferPtr operand_buffer(const Call& call, const OperandRef& ref) {
  switch (ref.kind) {
    case OperandRef::Host:
      return host_operand(item_tensor(call.args[ref.arg], ref.item), call.device);
    case OperandRef::Scalar:
      return scalar_buffer(call.args[ref.arg].toScalar(), ref.element, call.device);
    case OperandRef::Offset:
      return scalar_buffer(item_tensor(call.args[ref.arg], ref.item).storage_offset(), ElementType::S64, call.device);
    case OperandRef::Stride:
      return scalar_buffer(item_tensor(call.args[ref.arg], ref.item).stride(ref.dim), ElementType::S64, call.device);
    case OperandRef::Length:
      return scalar_buffer(item_tensor(call.args[ref.arg], ref.item).numel(), ElementType::S64, call.device);
    case OperandRef::Size:
      return scalar_buffer(item_tensor(call.args[ref.arg], ref.item).size(ref.dim), ElementType::S64, call.device);
    case OperandRef::Position: {
      int64_t start = 0;
      for (int k = 0; k < ref.item; ++k) start += item_tensor(call.args[ref.arg], k).numel();
      return scalar_buffer(start, ElementType::S64, call.device);
    }
    case OperandRef::Rng: {
      std::optional<at::Generator> gen;
      if (ref.arg >= 0 && call.args[ref.arg].isGenerator()) gen = call.args[ref.arg].toGenerator();
      return rng_state_buffer(next_rng_draw(gen, call.device, ref.count), call.device);
    }
    case OperandRef::Storage:
      break;
  }
  // A storage's buffer: the caller holds storage_mutex().
  return storage_state(item_tensor(call.args[ref.arg], ref.item).storage()).buffer;
}

// ---- flat cats: growing sequences ----
// transformers appends one token per step (`torch.cat([input_ids, next], -1)`,
// GPT-2's position_ids): with sizes in the key every step would compile anew.
// A flat cat keys by its pieces' storage extents and its result's capacity
// (the next power of two, at least kMinFlatCapacity elements); its result is a
// capacity storage, and slices of it ([:, -1:]) take runtime offsets (and, for
// several rows, runtime strides), so a sequence growing inside one bucket
// reuses every program.
//
// Several rows (a batch of sequences each growing by a column: input_ids,
// attention_mask; a KV cache [batch, heads, length, width]) cost a gather and
// a scatter instead of XLA's concatenate, so only small integer or bool
// tensors (the bookkeeping generation grows per token) and cats extending a
// cat's result (StorageState::grown: a dynamic KV cache from its second step)
// take that path; activations (a rotary embedding's halves) keep the
// concatenate and exact-size buffers.
constexpr int64_t kMinFlatCapacity = 64;
constexpr int64_t kMaxRowCatElements = int64_t{1} << 16;

namespace {
// The cat's pieces when they qualify (see flat_cat_of), with its dim.
std::optional<std::pair<c10::List<at::Tensor>, int64_t>> flat_cat_pieces(const Call& call) {
  if (!schema_facts(call.schema).is_cat || !call.args[0].isTensorList()) return std::nullopt;
  auto list = call.args[0].toTensorList();
  if (list.size() < 2) return std::nullopt;
  at::Tensor first = list.get(0);
  if (!first.defined() || first.dim() == 0) return std::nullopt;
  int64_t dim = call.args[1].toInt();
  if (dim < -first.dim() || dim >= first.dim()) return std::nullopt;  // the meta kernel's error
  dim = dim < 0 ? dim + first.dim() : dim;
  if (!first.is_contiguous()) return std::nullopt;  // the growing piece is read flat
  for (const at::Tensor& t : list) {
    // Later pieces (the new token: a KV projection's transposed view) may be strided: read
    // through their strides, which the key then holds (KeyBuilder::tensor).
    if (!t.defined() || t.device() != first.device() || t.device().type() != kTpu ||
        t.scalar_type() != first.scalar_type() || t.dim() != first.dim() || t.numel() == 0 ||
        t.is_conj() || t.is_neg() || !element_of(t.scalar_type()))
      return std::nullopt;
    for (int64_t d = 0; d < t.dim(); ++d)
      if (d != dim && t.size(d) != first.size(d)) return std::nullopt;
  }
  return std::make_pair(list, dim);
}
}  // namespace

namespace {
thread_local bool g_exact_shapes = false;  // see ExactShapes
}  // namespace
ExactShapes::ExactShapes() : previous_(g_exact_shapes) { g_exact_shapes = true; }
ExactShapes::~ExactShapes() { g_exact_shapes = previous_; }

FlatCat flat_cat_of(const Call& call) {
  if (g_exact_shapes) return {};
  auto pieces = flat_cat_pieces(call);
  if (!pieces) return {};
  const at::Tensor first = pieces->first.get(0);
  int64_t rows = 1, total = 0;
  for (int64_t d = 0; d < pieces->second; ++d) rows *= first.size(d);
  for (const at::Tensor& t : pieces->first) total += t.numel();
  if (rows > 1 && !at::isComplexType(first.scalar_type())) {
    // Small integer or bool bookkeeping (input_ids, attention_mask), or a float sequence growing by a cat per step
    // (a decoding KV cache): first a cat, then every later cat extends a capacity storage.
    const bool bookkeeping = !at::isFloatingType(first.scalar_type()) && total <= kMaxRowCatElements;
    // Activations that autograd tracks (a DenseNet's features) keep the concatenate and exact buffers.
    if (!bookkeeping && (!storage_state(first.storage()).grown || first.requires_grad())) return {};
  } else if (rows > 1) {
    return {};
  }
  int64_t capacity = kMinFlatCapacity;
  while (capacity < total) capacity *= 2;
  return {capacity, rows};
}

// ---- elementwise ops over capacity storages ----
// Generation computes on its growing bookkeeping too: `attention_mask.bool()`,
// `masked_fill_`, comparisons. An elementwise op over whole capacity
// storages runs on their whole buffers (the padding past the logical size
// computes garbage that nothing reads), so its program depends on the
// capacity alone and its results are capacity storages.
int64_t capacity_elementwise_of(const Call& call, const lowering::LoweringEntry& entry) {
  if (!entry.elementwise || g_exact_shapes) return 0;
  bool any = false;  // most calls have no capacity storage: a cheap first pass
  for (const c10::IValue& v : call.args)
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kTpu &&
        storage_state(v.toTensor().storage()).capacity > 0) {
      any = true;
      break;
    }
  if (!any) return 0;
  int64_t capacity = 0;
  const at::Tensor* shape = nullptr;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const c10::IValue& v = call.args[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || t.dim() == 0) continue;  // 0-d values broadcast
      if (t.device().type() != kTpu || t.numel() == 0) return 0;  // an empty plan skips its program
      const StorageState& st = storage_state(t.storage());
      if (!t.is_contiguous() || t.storage_offset() != 0 || t.is_conj() || t.is_neg()) return 0;
      if (shape && !t.sizes().equals(shape->sizes())) return 0;
      if (!shape) shape = &t;
      if (st.capacity == 0) {
        // A destination made for the result (`x.bool()`: empty, then copy_) becomes a capacity storage (adopt_capacity).
        bool written = is_written(call, static_cast<int>(i));
        if (!written || storage_type(st)) return 0;
        continue;
      }
      // Its extent: a capacity storage resized past its capacity holds its new size.
      const int64_t elements = static_cast<int64_t>(extent_bytes(st) / t.element_size());
      if (capacity == 0) capacity = elements;
      else if (elements != capacity) return 0;
    } else if (v.isList() || v.isTensorList()) {
      return 0;
    } else if (v.isDevice()) {
      if (v.toDevice().type() != kTpu) return 0;
    } else if (!v.isNone() && call.schema.arguments()[i].name() == "memory_format") {
      auto format = v.toMemoryFormat();
      if (format != c10::MemoryFormat::Contiguous && format != c10::MemoryFormat::Preserve) return 0;
    }
  }
  if (capacity == 0) return 0;
  // A written tensor covers its storage's whole logical size: past it the buffer is padding, free to overwrite.
  for (int w : call.written) {
    const at::Tensor& t = call.args[w].toTensor();
    if (t.dim() == 0 || static_cast<size_t>(t.nbytes()) != storage_state(t.storage()).nbytes) return 0;
  }
  return capacity;
}

// Gives the written tensors that are not capacity storages yet (fresh, never
// written) the op's capacity, once its plan is known to run on the device.
void adopt_capacity(Call& call, int64_t capacity) {
  for (int w : call.written) {
    const at::Tensor& t = call.args[w].toTensor();
    StorageState& st = storage_state(t.storage());
    if (st.capacity > 0) continue;
    st.capacity = static_cast<size_t>(capacity) * t.element_size();
    if (KeyedStorage* keyed = find_keyed(call, &st)) keyed->extent = extent_bytes(st);
  }
}

// ---- runtime-length ops ----
// A left-padded batch's attention mask is built anew each token from
// `arange(length)`, comparisons broadcast against it, an index of the 2-d mask
// by it and a sum that tests it: every shape holds the length in its last dim.
// Such an op reads each tensor whose last dim is the length padded to a bound
// (its rows gathered from a capacity storage at the runtime length; the
// padding holds LoweringEntry::length_padding), computes at the bound, and
// packs each result whose last dim is the length into a capacity storage: its
// key and program hold the bound, the length is a runtime operand.
namespace {
// Covers a capacity storage contiguously from its start: read padded.
bool covers_capacity(const at::Tensor& t) {
  if (t.device().type() != kTpu || t.dim() == 0 || t.numel() == 0 || !t.is_contiguous() || t.storage_offset() != 0 ||
      t.is_conj() || t.is_neg())
    return false;
  const StorageState& st = storage_state(t.storage());
  return st.capacity > 0 && static_cast<size_t>(t.nbytes()) == st.nbytes;
}
// A destination never written (`out=`, an empty made for the result) and all of its storage: it takes the
// result's shape, and its whole buffer is rewritten.
bool fresh_destination(const at::Tensor& t) {
  const StorageState& st = storage_state(t.storage());
  return t.device().type() == kTpu && st.capacity == 0 && !storage_type(st) && t.storage_offset() == 0 &&
         t.is_contiguous() && !t.is_conj() && !t.is_neg() && static_cast<size_t>(t.nbytes()) == st.nbytes;
}
// Calls fn(tensor, arg, item) for each tensor argument and list item.
template <typename Fn>
void for_each_tensor(const Call& call, Fn fn) {
  for (size_t i = 0; i < call.args.size(); ++i) {
    const c10::IValue& v = call.args[i];
    if (v.isTensor()) {
      fn(v.toTensor(), static_cast<int>(i), -1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) fn(list.get(k), static_cast<int>(i), static_cast<int>(k));
    } else if (v.isList()) {  // Tensor?[] (index's indices)
      auto list = v.toList();
      for (size_t k = 0; k < list.size(); ++k) {
        c10::IValue x = list.get(k);
        if (x.isTensor()) fn(x.toTensor(), static_cast<int>(i), static_cast<int>(k));
      }
    }
  }
}

// arange's length from integer Scalars (0 if they are not integers or give none).
int64_t arange_length(const Call& call) {
  const auto& args = call.schema.arguments();
  int64_t start = 0, end = 0, step = 1;
  bool has_end = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& name = args[i].name();
    if (name != "start" && name != "end" && name != "step") continue;
    if (!call.args[i].isInt()) return 0;
    (name == "start" ? start : name == "end" ? end : step) = call.args[i].toInt();
    has_end = has_end || name == "end";
  }
  if (!has_end || step == 0 || (end - start) / step < 0) return 0;
  return (end - start + step + (step > 0 ? -1 : 1)) / step;
}
// An arange whose result can be a capacity storage: integral, on tpu, into a new tensor or an empty `out=`.
bool runtime_length_arange(const Call& call) {
  const auto& args = call.schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = call.args[i];
    const std::string& name = args[i].name();
    if (name == "dtype" && !v.isNone()) {
      if (!at::isIntegralType(v.toScalarType(), /*includeBool=*/false)) return false;
    } else if (name == "out") {
      const at::Tensor& out = v.toTensor();
      if (!at::isIntegralType(out.scalar_type(), false) || !fresh_destination(out) || out.numel() != 0) return false;
    } else if (name == "device" && !v.isNone() && v.toDevice().type() != kTpu) {
      return false;
    }
  }
  return true;
}
}  // namespace

constexpr int64_t kMaxRuntimeArange = int64_t{1} << 20;

RuntimeLength runtime_length_of(const Call& call, const lowering::LoweringEntry& entry) {
  RuntimeLength r;
  if (g_exact_shapes) return {};
  if (entry.bake_scalars) {  // arange: its result grows with its end
    if (base_name(call.schema) != "arange" || !runtime_length_arange(call)) return {};
    r.length = arange_length(call);
    // Small ones only (a mask's positions): the buffer is up to twice the length.
    if (r.length < 2 || r.length > kMaxRuntimeArange) return {};
    r.bound = kMinFlatCapacity;
    while (r.bound < r.length) r.bound *= 2;
    return r;
  }
  if (!entry.elementwise && !entry.length_padding) return {};
  // The length: the last dim of the first tensor covering a capacity storage (most calls have none).
  for_each_tensor(call, [&](const at::Tensor& t, int arg, int item) {
    if (r.length == 0 && t.defined() && t.dim() > 0 && t.size(-1) > 1 && covers_capacity(t)) {
      r.length = t.size(-1);
      r.arg = arg;
      r.item = item;
    }
  });
  if (r.length == 0) return {};
  bool ok = true;
  r.bound = std::numeric_limits<int64_t>::max();
  for_each_tensor(call, [&](const at::Tensor& t, int arg, int item) {
    if (!ok || !t.defined()) return;
    if (t.device().type() != kTpu) {
      ok = t.dim() == 0;  // a CPU scalar
      return;
    }
    const bool written = is_written(call, arg);
    if (t.dim() > 0 && t.size(-1) == r.length && covers_capacity(t)) {
      const int64_t rows = t.numel() / r.length;
      const int64_t elements = static_cast<int64_t>(extent_bytes(storage_state(t.storage())) / t.element_size());
      r.bound = std::min(r.bound, elements / rows);
    } else if (written) {
      ok = fresh_destination(t);  // takes the result's shape and capacity
    } else {
      ok = t.dim() == 0 || (t.size(-1) == 1 && t.numel() > 0);  // broadcasts along the length
    }
  });
  for (size_t i = 0; ok && i < call.args.size(); ++i) {
    const c10::IValue& v = call.args[i];
    if (v.isDevice()) {
      ok = v.toDevice().type() == kTpu;
    } else if (!v.isNone() && call.schema.arguments()[i].name() == "memory_format") {
      auto format = v.toMemoryFormat();
      ok = format == c10::MemoryFormat::Contiguous || format == c10::MemoryFormat::Preserve;
    }
  }
  if (!ok || r.bound < r.length) return {};
  return r;
}

int64_t runtime_length(const Call& call, const MetaResult& meta) {
  if (meta.length_arg < 0) return arange_length(call);
  return item_tensor(call.args[meta.length_arg], meta.length_item).size(-1);
}

namespace {
// The call with its length `length` instead: the tensors holding it in their last dim, as meta tensors.
Call lengthened(const Call& call, int64_t old_length, int64_t length) {
  Call longer = call;
  for (size_t i = 0; i < longer.args.size(); ++i) {
    longer.args[i] = map_tensors(call.args[i], [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kTpu || t.dim() == 0 || t.size(-1) != old_length) return t;
      std::vector<int64_t> sizes = t.sizes().vec();
      sizes.back() = length;
      return at::empty(sizes, t.options().device(at::kMeta));
    });
  }
  return longer;
}
}  // namespace

// Which outputs hold the length in their last dim: the meta kernel once more, at the length plus one. An op
// whose outputs depend on it otherwise is planned for this length only (CachedOp::exact_length).
void plan_runtime_length(const Call& call, CachedOp& cached, const RuntimeLength& length) {
  MetaResult& meta = cached.meta;
  std::vector<bool> padded(meta.outputs.size(), length.arg < 0);  // arange: its one result
  if (length.arg >= 0) {
    MetaResult longer;
    try {
      longer = infer_meta(lengthened(call, length.length, length.length + 1));
    } catch (const std::exception&) {
      cached.exact_length = length.length;
      return;
    }
    if (longer.outputs.size() != meta.outputs.size()) {
      cached.exact_length = length.length;
      return;
    }
    for (size_t i = 0; i < meta.outputs.size(); ++i) {
      const lowering::Dims &a = meta.outputs[i].dims, &b = longer.outputs[i].dims;
      if (a == b) continue;
      bool last_only = a.size() == b.size() && !a.empty() && a.back() == length.length &&
                       b.back() == length.length + 1 && std::equal(a.begin(), a.end() - 1, b.begin()) &&
                       meta.strides[i].empty();
      if (!last_only) {
        cached.exact_length = length.length;
        return;
      }
      padded[i] = true;
    }
  }
  meta.length_bound = length.bound;
  meta.length_arg = length.arg;
  meta.length_item = length.item;
  meta.length_padding = cached.entry->length_padding.value_or(0);
  meta.padded_outputs = padded;
  for (size_t i = 0; i < padded.size(); ++i)
    if (padded[i]) meta.outputs[i].dims.back() = length.bound;
}

namespace {
// A padded output's sizes for this call, and its buffer's elements (rows * bound).
std::pair<std::vector<int64_t>, int64_t> padded_output_shape(const Call& call, const CachedOp& cached, size_t i) {
  std::vector<int64_t> sizes = cached.outputs[i].dims;
  sizes.back() = runtime_length(call, cached.meta);
  const int64_t rows = c10::multiply_integers(sizes.begin(), sizes.end() - 1);
  return {sizes, rows * cached.meta.length_bound};
}
}  // namespace

// Written padded outputs take this call's sizes, and fresh ones become capacity storages; other written outputs
// (a fresh `out=` of a reduction over the length) take the planned sizes, as resize_outputs gives them.
void resize_padded_outputs(Call& call, const CachedOp& cached) {
  for (size_t i = 0; i < cached.outputs.size(); ++i) {
    const OutputPlan& p = cached.outputs[i];
    if (!p.write) continue;
    if (!cached.meta.padded_outputs[i]) {
      resize_written(call, p, p.dims);
      continue;
    }
    auto [sizes, elements] = padded_output_shape(call, cached, i);
    at::Tensor t = resize_written(call, p, sizes);
    StorageState& st = storage_state(t.storage());
    if (st.capacity > 0) continue;
    st.capacity = static_cast<size_t>(elements) * t.element_size();
    if (KeyedStorage* keyed = find_keyed(call, &st)) keyed->extent = extent_bytes(st);
  }
}

// The empty kernels' tensor, made without a dispatch: recording makes one per op.
at::Tensor new_device_tensor(c10::IntArrayRef sizes, std::optional<c10::IntArrayRef> strides, at::ScalarType dtype,
                             int device, std::optional<c10::MemoryFormat> memory_format) {
  static const c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  element_or_throw(dtype);  // a dtype XLA has no type for must never hold (zero) data
  c10::DeviceGuard on_device(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  c10::Allocator* allocator = c10::GetAllocator(kTpu);
  return strides ? at::detail::empty_strided_generic(sizes, *strides, allocator, keys, dtype)
                 : at::detail::empty_generic(sizes, allocator, keys, dtype, memory_format);
}

namespace {
// A capacity storage of `capacity` elements holding a contiguous tensor of these sizes.
at::Tensor new_capacity_tensor(c10::IntArrayRef sizes, at::ScalarType dtype, int device, int64_t capacity) {
  at::Tensor out = new_device_tensor(sizes, std::nullopt, dtype, device);
  storage_state(out.storage()).capacity = static_cast<size_t>(capacity) * out.element_size();
  return out;
}

// A new result of a capacity elementwise op: the shape of this call's tensors (the plan keeps no sizes).
at::Tensor capacity_elementwise_output(const Call& call, at::ScalarType dtype, int64_t capacity) {
  c10::IntArrayRef sizes;
  for (const c10::IValue& v : call.args)
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().dim() > 0) {
      sizes = v.toTensor().sizes();
      break;
    }
  return new_capacity_tensor(sizes, dtype, call.device, capacity);
}
}  // namespace

// A flat cat's result: sizes from this call, a buffer of `capacity` elements.
at::Tensor flat_cat_output(const Call& call, int64_t capacity) {
  auto list = call.args[0].toTensorList();
  at::Tensor first = list.get(0);
  int64_t dim = c10::maybe_wrap_dim(call.args[1].toInt(), first.dim());
  std::vector<int64_t> sizes = first.sizes().vec();
  sizes[dim] = 0;
  for (const at::Tensor& t : list) sizes[dim] += t.size(dim);
  at::Tensor out = new_capacity_tensor(sizes, first.scalar_type(), call.device, capacity);
  storage_state(out.storage()).grown = true;
  return out;
}

// The op's outputs: written arguments, or new tensors on the call's device.
std::vector<at::Tensor> output_tensors(const Call& call, const CachedOp& cached) {
  if (cached.meta.flat_capacity > 0) return {flat_cat_output(call, cached.meta.flat_capacity)};
  std::vector<at::Tensor> outs;
  for (const OutputPlan& p : cached.outputs) {
    if (p.absent) outs.emplace_back();
    else if (p.write) outs.push_back(item_tensor(call.args[p.arg], p.item));
    else if (cached.meta.capacity > 0) outs.push_back(capacity_elementwise_output(call, p.dtype, cached.meta.capacity));
    else if (cached.meta.length_bound > 0 && cached.meta.padded_outputs[outs.size()]) {
      auto [sizes, elements] = padded_output_shape(call, cached, outs.size());
      outs.push_back(new_capacity_tensor(sizes, p.dtype, call.device, elements));
    }
    else if (p.strides.empty()) outs.push_back(new_device_tensor(p.dims, std::nullopt, p.dtype, call.device));
    else outs.push_back(new_device_tensor(p.dims, p.strides, p.dtype, call.device));
  }
  if (cached.cat && outs.size() == 1 && outs[0].defined() && !cached.outputs[0].write)
    storage_state(outs[0].storage()).grown = true;
  return outs;
}

void push_returns(torch::jit::Stack* stack, size_t nargs, const CachedOp& cached, const std::vector<at::Tensor>& outs) {
  torch::jit::drop(*stack, nargs);
  size_t next = 0;
  size_t number = 0;
  for (int count : cached.return_counts) {
    if (count == kNumberReturn) {
      stack->push_back(c10::IValue(cached.meta.numbers[number++]));
    } else if (count == 1 || count == 0) {
      stack->push_back(outs[next++]);
    } else {
      std::vector<at::Tensor> list(outs.begin() + next, outs.begin() + next + (-count - 1));
      next += list.size();
      stack->push_back(c10::IValue(list));
    }
  }
}

void note_cpu_fallback(const std::string& name, const std::string& why) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  bool first;
  {
    std::lock_guard<std::mutex> lock(mutex);
    first = warned.insert(name).second;
  }
  graph::count_cpu_fallback(name, graph::capture_source_location());
  if (first) {
    TORCH_WARN("torch_pjrt: ", name, " runs on the CPU (", why,
               "); it copies its tensors to the host and back. See torch_pjrt.metrics()['cpu_fallbacks'].");
  }
}
void lowered_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  ExitGate gate;  // first, so destroyed last (exit_gate.h)
  check_not_forked();
  std::string why;
  try {
    if (run_lowered(op, stack, &why)) return;
  } catch (const pjrt::Error& e) {
    raise_device_error(c10::str(op_name(op.schema()), " failed on the tpu device: ", e.what()));
  }
  cpu_fallback(op, stack, why);
}

namespace {
// t's value on the host, read into `into` when that is a dense CPU tensor of t's sizes and dtype (a
// `.cpu()` then holds one host copy, not a staging copy as well), else into a new tensor.
at::Tensor read_to_host(const at::Tensor& t, const at::Tensor& into) {
  TORCH_CHECK(t.device().type() == kTpu, "to_host expects a tpu tensor");
  check_not_forked();
  const StorageState& st = storage_state(t.storage());
  pjrt::BufferPtr buffer = readable_buffer(st);  // our reference: other threads may install new ones
  raise_failed_checks(st.device);  // reading waits anyway: failed index/division checks surface here
  bool fits = into.defined() && into.is_cpu() && into.scalar_type() == t.scalar_type() && into.is_contiguous() &&
              into.sizes().equals(t.sizes()) && !into.is_conj() && !into.is_neg();
  at::Tensor out = fits ? into : at::empty(t.sizes(), t.options().device(at::kCPU));
  if (t.numel() == 0) return out;
  check_has_value(st);
  if (!buffer) return out.zero_();
  ElementType e = element_or_throw(t.scalar_type());
  // A capacity storage's buffer holds more than the tensor covering it, and a prefix of a buffer at most twice
  // its size (a batch cut back from its bucket) costs less to read whole than a slicing program per size: read
  // the buffer, keep the prefix.
  int64_t have = static_cast<int64_t>(buffer->element_count());
  bool covers = have == t.numel() || (have > t.numel() && have <= 2 * t.numel()) ||
                (st.capacity > 0 && have > t.numel() && static_cast<size_t>(t.nbytes()) == st.nbytes);
  bool direct = t.is_contiguous() && t.storage_offset() == 0 && buffer->element_type() == e && covers &&
                !t.is_conj() && !t.is_neg();  // clone applies the bits
  if (!direct) {
    torch::jit::Stack stack{t, c10::MemoryFormat::Contiguous};  // row-major, whatever t's layout
    static const auto& clone = find_op("aten::clone", "");
    run_or_throw(clone, &stack);
    return read_to_host(stack.back().toTensor(), out);
  }
  at::Tensor whole = buffer->element_count() == t.numel() ? out : at::empty({buffer->element_count()}, out.options());
  try {
    buffer->to_host(whole.mutable_data_ptr());
  } catch (const pjrt::Error& e) {
    raise_device_error(c10::str("reading a tpu tensor failed: ", e.what()));
  }
  if (!whole.is_same(out)) out.view(-1).copy_(whole.narrow(0, 0, t.numel()));
  metrics().device_to_host_bytes += static_cast<int64_t>(out.nbytes());
  return out;
}
}  // namespace

at::Tensor to_host(const at::Tensor& t) { return read_to_host(t, at::Tensor()); }

void copy_into(const at::Tensor& dst, const at::Tensor& src) {
  check_not_forked();
  if (dst.device().type() != kTpu) {
    at::Tensor host = read_to_host(src, dst);
    if (!host.is_same(dst)) dst.copy_(host);
    return;
  }
  at::Tensor source = src;
  if (src.device().type() == kTpu && src.device() != dst.device()) source = to_host(src);
  if (source.device().is_cpu()) source = source.resolve_conj().resolve_neg();  // host operands are raw bytes
  StorageState& st = storage_state(dst.storage());
  bool whole = dst.is_contiguous() && dst.storage_offset() == 0 && !dst.is_conj() && !dst.is_neg() &&
               static_cast<size_t>(dst.numel()) * dst.element_size() == st.nbytes;
  if (whole && source.device().is_cpu() && source.sizes().equals(dst.sizes()) && dst.numel() > 0) {
    // The common `.to("tpu")`: upload straight into the storage. A recorded
    // graph that writes this storage runs first, so its result cannot land later.
    install_after_graph(st, upload(source.to(dst.scalar_type()), dst.device().index(), /*as_storage=*/true));
    return;
  }
  torch::jit::Stack stack{dst, source, false};
  static const auto& copy = find_op("aten::copy_", "");
  std::string why;
  bool ok = false;
  try {
    ok = run_lowered(copy, &stack, &why);
  } catch (const pjrt::Error& e) {
    raise_device_error(c10::str("copy to the tpu device failed: ", e.what()));
  }
  TORCH_CHECK(ok, "copy to the tpu device is not supported: ", why);
}

void synchronize(int device) {
  check_not_forked();
  flush_pending(device);
  wait_host_transfers();  // after this, the sources of non_blocking copies may change
  std::deque<std::shared_ptr<Work>> pending = take_in_flight(device);
  try {
    for (auto& work : pending) work->done->wait();
  } catch (const pjrt::Error& e) {
    raise_device_error(c10::str("a tpu program on tpu:", device, " failed: ", e.what()));
  }
  raise_failed_checks(device);
}

void synchronize() {
  check_not_forked();
  for (DeviceContext* ctx : started_device_contexts()) synchronize(ctx->index);
  wait_host_transfers();
}

}  // namespace torch_pjrt
