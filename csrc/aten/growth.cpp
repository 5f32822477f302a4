// Growth: generation appends a token per step, and with sizes in every key each step would compile anew. Flat
// cats, elementwise ops over capacity storages and runtime-length ops key by a capacity bucket instead; their
// results are capacity storages. This file decides which calls grow so (growth_of), records it in their plans,
// and makes every op's output tensors (capacity storages where growth says so).
#include "aten/growth.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <limits>

#include "aten/device.h"
#include "aten/op_planning.h"

namespace torch_pjrt {

namespace {
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
}  // namespace
ExactShapes::ExactShapes() : previous_(g_exact_shapes) { g_exact_shapes = true; }
ExactShapes::~ExactShapes() { g_exact_shapes = previous_; }

namespace {

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

}  // namespace

int64_t runtime_length(const Call& call, const MetaResult& meta) {
  if (meta.length_arg < 0) return arange_length(call);
  return item_tensor(call.args[meta.length_arg], meta.length_item).size(-1);
}

namespace {

// ---- written outputs --------------------------------------------------------
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

}  // namespace

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
}  // namespace

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

Growth growth_of(const Call& call, const lowering::LoweringEntry& entry) {
  Growth growth;
  growth.flat = flat_cat_of(call);
  if (growth.flat.capacity == 0) growth.elementwise_capacity = capacity_elementwise_of(call, entry);
  if (growth.flat.capacity == 0 && growth.elementwise_capacity == 0) growth.length = runtime_length_of(call, entry);
  return growth;
}

void plan_growth(const Call& call, CachedOp& cached, const Growth& growth) {
  cached.meta.flat_capacity = growth.flat.capacity;
  cached.meta.flat_rows = growth.flat.rows;
  if (growth.elementwise_capacity > 0) {
    cached.meta.capacity = growth.elementwise_capacity;
    for (OutputMeta& o : cached.meta.outputs) o.dims = {growth.elementwise_capacity};
  }
  if (growth.length.length > 0) plan_runtime_length(call, cached, growth.length);
}

void shape_written_outputs(Call& call, const CachedOp& cached) {
  if (cached.meta.capacity > 0) adopt_capacity(call, cached.meta.capacity);  // written tensors keep their sizes
  else if (cached.meta.length_bound > 0) resize_padded_outputs(call, cached);
  else resize_outputs(call, cached.outputs);
}

}  // namespace torch_pjrt
