// Kernels PrivateUse1 needs by name: allocation, metadata-only views, resize,
// copies across devices, reading a scalar, and the boxed fallback that sends
// every other op to its lowering (executor.cpp).
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <mutex>
#include <set>

#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/executor.h"
#include "aten/fused_graph.h"
#include "aten/growth.h"
#include "aten/host_copy.h"
#include "aten/exit_gate.h"
#include "aten/streams.h"
#include "aten/lowering.h"
#include "aten/op_call.h"
#include "graph/metrics.h"

namespace torch_pjrt {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

c10::Device tpu_device(std::optional<c10::Device> device) {
  c10::Device d = device.value_or(c10::Device(kTpu));
  TORCH_CHECK(d.type() == kTpu, "expected a tpu device, got ", d);
  int index = d.has_index() ? d.index() : current_device();
  check_device_index(index);
  return c10::Device(kTpu, static_cast<c10::DeviceIndex>(index));
}

// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory:
// new memory reads NaN (floating, complex) or the dtype's max (integers), as
// the CPU and CUDA empty kernels fill it.
bool fill_uninitialized() {
  return at::globalContext().deterministicAlgorithms() && at::globalContext().deterministicFillUninitializedMemory();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "tpu tensors are strided; got layout ", *layout);
  at::ScalarType type = dtype.value_or(at::get_default_dtype_as_scalartype());
  at::Tensor t = new_device_tensor(size, std::nullopt, type, tpu_device(device).index(), memory_format);
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<c10::Device> device, std::optional<bool>) {
  TORCH_CHECK(!layout || *layout == at::kStrided, "tpu tensors are strided; got layout ", *layout);
  at::ScalarType type = dtype.value_or(at::get_default_dtype_as_scalartype());
  at::Tensor t = new_device_tensor(size, stride, type, tpu_device(device).index());
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_empty_deterministic_(t);
  return t;
}

// Grows a storage in place; the bytes past the old end read as zeros.
void ensure_storage_bytes(const at::Tensor& self, size_t needed) {
  const c10::Storage& storage = self.storage();
  if (needed <= storage.nbytes()) return;
  TORCH_CHECK(storage.resizable(), "Trying to resize storage that is not resizable");
  resize_storage_after_graph(storage, needed);
}

size_t bytes_needed(c10::IntArrayRef size, c10::IntArrayRef stride, int64_t offset, size_t itemsize) {
  int64_t last = offset;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] == 0) return 0;
    last += (size[i] - 1) * stride[i];
  }
  return static_cast<size_t>(last + 1) * itemsize;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> format) {
  for (int64_t s : size) TORCH_CHECK(s >= 0, "Trying to create tensor with negative dimension ", s, ": ", size);
  TORCH_CHECK(format != c10::MemoryFormat::Preserve, "Unsupported memory format", *format);
  auto* impl = self.unsafeGetTensorImpl();
  // As the CPU's resize_: the same sizes keep their strides (a transposed or
  // channels_last tensor reads the same values); new sizes are row-major; an
  // asked layout then restrides.
  if (self.sizes().equals(size) && !format) return self;
  if (!self.sizes().equals(size)) impl->set_sizes_contiguous(size);
  if (format) impl->empty_tensor_restride(*format);
  const auto old_nbytes = static_cast<int64_t>(self.storage().nbytes());
  ensure_storage_bytes(self, bytes_needed(self.sizes(), self.strides(), self.storage_offset(), self.element_size()));
  if (C10_UNLIKELY(fill_uninitialized())) at::native::fill_resize_deterministic_(self, old_nbytes);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kTpu, "set_: expected a tpu storage, got one on ", source.device());
  auto* impl = self.unsafeGetTensorImpl();
  if (!impl->storage().is_alias_of(source)) impl->set_storage_keep_dtype(std::move(source));
  std::vector<int64_t> sizes, strides;
  for (const auto& s : size) sizes.push_back(s.expect_int());
  for (const auto& s : stride) strides.push_back(s.expect_int());
  impl->set_sizes_and_strides(sizes, strides, offset.expect_int());
  ensure_storage_bytes(self, bytes_needed(sizes, strides, offset.expect_int(), self.element_size()));
  return self;
}

at::Tensor& set_storage_plain(at::Tensor& self, c10::Storage source) {
  int64_t count = static_cast<int64_t>(source.nbytes() / self.element_size());
  c10::SymInt n(count);
  std::vector<c10::SymInt> size{n}, stride{c10::SymInt(1)};
  return set_storage(self, std::move(source), c10::SymInt(0), size, stride);
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) return self;
  std::vector<c10::SymInt> size(source.sym_sizes().begin(), source.sym_sizes().end());
  std::vector<c10::SymInt> stride(source.sym_strides().begin(), source.sym_strides().end());
  return set_storage(self, source.storage(), source.sym_storage_offset(), size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(kTpu), true);
  std::vector<c10::SymInt> size{c10::SymInt(0)}, stride{c10::SymInt(1)};
  return set_storage(self, std::move(storage), c10::SymInt(0), size, stride);
}

// `dst.copy_(src, non_blocking=True)` from pinned host memory into a whole tpu
// storage: the upload is enqueued and not waited for (the plugin reads `src`
// until its done event, which keeps `src` alive; synchronize() waits), so it
// overlaps with device work and host work alike. False: take the usual path.
bool upload_pinned_async(const at::Tensor& dst, const at::Tensor& src) {
  if (!src.is_cpu() || dst.device().type() != kTpu || src.scalar_type() != dst.scalar_type() ||
      !src.is_contiguous() || src.is_conj() || src.is_neg() || !src.sizes().equals(dst.sizes()) || dst.numel() == 0 ||
      !is_pinned_host_ptr(src.storage().data()))
    return false;
  StorageState& st = storage_state(dst.storage());
  if (!dst.is_contiguous() || dst.storage_offset() != 0 || static_cast<size_t>(dst.nbytes()) != st.nbytes) return false;
  check_not_forked();
  c10::DeviceGuard guard(dst.device());
  auto [buffer, done] = client().buffer_from_host_async(src.const_data_ptr(), element_or_throw(src.scalar_type()),
                                                        {dst.numel()}, dst.device().index());
  graph::metrics().host_to_device_bytes += static_cast<int64_t>(src.nbytes());
  install_after_graph(st, std::move(buffer));  // a recorded graph writing dst runs first
  hold_until_transferred(std::move(done), src);
  return true;
}

// A non_blocking copy of a tpu tensor into pinned host memory returns once the
// read is launched, as a CUDA one does: the read is the device's work, which
// synchronize(), Events and Streams wait for, and until then the host tensor
// holds whatever it held. The host tensor and the buffer stay alive until it
// is done. Anything else (pageable memory, a view to gather) reads at once.
bool download_pinned_async(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_cpu() || src.device().type() != kTpu || src.scalar_type() != dst.scalar_type() ||
      !dst.is_contiguous() || !src.is_contiguous() || src.storage_offset() != 0 || src.is_conj() || src.is_neg() ||
      dst.is_conj() || dst.is_neg() || !src.sizes().equals(dst.sizes()) || src.numel() == 0 ||
      !is_pinned_host_ptr(dst.storage().data()))
    return false;
  check_not_forked();
  c10::DeviceGuard guard(src.device());
  const StorageState& st = storage_state(src.storage());
  pjrt::BufferPtr buffer = readable_buffer(st);  // runs the recorded graph that writes it
  if (!buffer || st.lost || buffer->element_type() != element_or_throw(src.scalar_type()) ||
      buffer->element_count() != src.numel())
    return false;  // no value (the read raises why), or a capacity buffer to cut: read at once
  auto done = buffer->to_host_async(dst.mutable_data_ptr());
  graph::metrics().device_to_host_bytes += static_cast<int64_t>(dst.nbytes());
  auto work = device_context(st.device).track_work(std::move(done), nullptr);
  if (work) work->holds = std::make_shared<std::pair<at::Tensor, pjrt::BufferPtr>>(dst, std::move(buffer));
  return true;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  ExitGate gate;  // a device entry point (exit_gate.h), as are the two below
  if (non_blocking && (upload_pinned_async(dst, self) || download_pinned_async(dst, self))) return dst;
  copy_into(dst, self);  // waits for the host memory to be read
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  ExitGate gate;
  if (!dst.sizes().equals(self.sizes())) dst.resize_(self.sizes());
  copy_into(dst, self);
  return dst;
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  ExitGate gate;
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(), " elements cannot be converted to Scalar");
  return to_host(self).item();
}

// torch.equal returns a Python bool: same sizes and every element equal
// (after type promotion; NaN is never equal), read back from one reduction.
bool equal(const at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device() == other.device(), "Expected all tensors to be on the same device, but found ",
              self.device(), " and ", other.device(), " (in torch.equal)");
  if (!self.sizes().equals(other.sizes())) return false;
  if (self.numel() == 0) return true;
  return at::eq(self, other).all().item<bool>();
}

// Dense cpu and tpu tensors may swap data in place (`param.data = t`), as cpu
// and cuda tensors do: nn.Module._apply then moves a module by keeping its
// Parameter objects (ties, optimizers built before the move, .grad) instead of
// making new ones. c10's built-in rule lists only the in-tree dense backends.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense_cpu_or_tpu = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.device().type() == kTpu || t.device().is_cpu());
  };
  if (dense_cpu_or_tpu(self) && dense_cpu_or_tpu(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// Views that reinterpret a complex storage as (re, im) pairs and back. A dtype
// XLA has no type for (complex32 of a half tensor) raises, as empty() does.
at::Tensor view_as_real(const at::Tensor& self) {
  at::Tensor out = at::native::view_as_real(self);
  element_or_throw(out.scalar_type());
  return out;
}
at::Tensor view_as_complex(const at::Tensor& self) {
  at::Tensor out = at::native::view_as_complex(self);
  element_or_throw(out.scalar_type());
  return out;
}

// tensor.record_stream(s): the storage's memory outlives the stream's work already (streams.h: PJRT frees a
// destroyed buffer's memory only once the work using it is done); checks that `s` is a tpu stream of a device.
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kTpu, "record_stream: expected a tpu stream for a tpu tensor, got a ",
              stream.device_type(), " stream");
  stream_bit(stream.id());  // checks the id
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("record_stream", record_stream);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  // storage_as (strided_view.cpp) converts the flat buffer's type on read.
  m.impl("view_as_real", view_as_real);
  m.impl("view_as_complex", view_as_complex);
  m.impl("unfold", at::native::unfold);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_storage_plain);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("equal", equal);
}

// Ops whose generic (CompositeExplicitAutograd) kernels would route to a
// device hook that throws (convolution_overrideable) or reject devices other
// than CPU/CUDA/XPU (mode's out= form): their rules send them to the lowerings
// (or the CPU), Route::ToLowering.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const std::string& name : lowering::rule_names()) {
    const lowering::OpRule* rule = lowering::find_rule(lowering::base_name_of(name), lowering::overload_of(name), "");
    if (rule && rule->route == lowering::Route::ToLowering)
      m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&lowered_fallback>());
  }
}

// _copy_from's schema does not mark `dst` as written, so PyTorch's conjugate
// and negative fallbacks would hand it a materialized temporary (the copy into
// `z.conj()` was lost). Let the bits through: copy_into reads and writes
// through them (call_context.cpp, read_through_bits).
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&lowered_fallback>());
}

// Silences the warnings of a block (a deliberate kernel override's).
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

}  // namespace

void register_lowered_kernels(const lowering::OpRule* overriding) {
  // Each call adds the ops that gained a lowering since (torch_pjrt.register_lowering); ops with a kernel
  // of their own on the device keep it, unless `overriding` is their rule (a lowering registered for
  // them from Python replaces a Python decomposition's kernel too).
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  // Replacing a device kernel is on purpose here: PyTorch's "Overriding a previously registered kernel"
  // warning would only show the user this file's build path.
  QuietWarnings quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  torch::Library* library = nullptr;  // never destroyed: its kernels stay registered
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasSchema()) continue;
    // Ops routed elsewhere on purpose keep their generic kernels (Route::KeepGeneric: copies across devices).
    const lowering::OpRule* rule =
        lowering::find_rule(base_name(op->schema()), name.overload_name, overriding ? overriding->platform : "");
    if (!rule || !rule->fn || rule->route == lowering::Route::KeepGeneric) continue;
    // Implicit composites must decompose above autograd; existing kernels stay.
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) && rule != overriding))
      continue;
    if (!library)
      library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&lowered_fallback>());
  }
}

}  // namespace torch_pjrt
