// Host <-> device transfers: uploads of an op's operands that are not storages (CPU tensors, Scalars through a
// per-device cache of scalar buffers, RNG states), reads of a tpu tensor to the host, and copy_ across devices.
// Kept apart from the executor: these move bytes, the executor decides what runs.
#include "aten/host_copy.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>

#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/executor.h"
#include "aten/fused_graph.h"
#include "aten/growth.h"
#include "aten/op_call.h"
#include "aten/runtime_checks.h"
#include "graph/metrics.h"
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

}  // namespace

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
    device_context(st.device).failures_reported();
    raise_device_error(c10::str("reading a tpu tensor failed: ", e.what()));
  }
  if (!whole.is_same(out)) out.view(-1).copy_(whole.narrow(0, 0, t.numel()));
  metrics().device_to_host_bytes += static_cast<int64_t>(out.nbytes());
  return out;
}
}  // namespace

at::Tensor to_host(const at::Tensor& t) { return read_to_host(t, at::Tensor()); }

pjrt::BufferPtr dense_buffer(at::Tensor t, ElementType element) {
  auto whole = [&](const at::Tensor& x) -> pjrt::BufferPtr {
    if (!x.is_contiguous() || x.storage_offset() != 0 || x.is_conj() || x.is_neg()) return nullptr;
    StorageState& st = storage_state(x.storage());
    check_has_value(st);
    pjrt::BufferPtr b = readable_buffer(st);  // after a recorded graph that writes it
    if (!b || b->element_type() != element || b->element_count() != x.numel()) return nullptr;
    return b;
  };
  if (auto b = whole(t)) return b;
  ExactShapes exact;  // not a capacity storage's larger buffer (a mask grown by cats, an arange)
  at::Tensor dense = t.resolve_conj().resolve_neg().clone(at::MemoryFormat::Contiguous);
  auto b = whole(dense);
  TORCH_CHECK(b, "internal: a dense copy of a ", t.sizes(), " tensor has no matching buffer");
  return b;
}

namespace {
// `src`'s value on tpu:`device`, copied by the plugin from src's device (PJRT_Buffer_CopyToDevice): no host
// round trip, and the copy is launched, not waited for (the destination buffer is ready when it lands).
pjrt::BufferPtr copied_to_device(const at::Tensor& src, int device) {
  pjrt::BufferPtr from = dense_buffer(src, element_or_throw(src.scalar_type()));
  try {
    pjrt::BufferPtr to = from->copy_to_device(client().device(static_cast<size_t>(device)));
    metrics().device_to_device_bytes += static_cast<int64_t>(to->byte_count());
    return to;
  } catch (const pjrt::Error& e) {
    raise_device_error(c10::str("copying a tpu:", src.device().index(), " tensor to tpu:", device, " failed: ", e.what()));
  }
}
}  // namespace

void copy_into(const at::Tensor& dst, const at::Tensor& src) {
  check_not_forked();
  if (dst.device().type() != kTpu) {
    at::Tensor host = read_to_host(src, dst);
    if (!host.is_same(dst)) dst.copy_(host);
    return;
  }
  at::Tensor source = src;
  if (source.device().is_cpu()) source = source.resolve_conj().resolve_neg();  // host operands are raw bytes
  StorageState& st = storage_state(dst.storage());
  bool whole = dst.is_contiguous() && dst.storage_offset() == 0 && !dst.is_conj() && !dst.is_neg() &&
               static_cast<size_t>(dst.numel()) * dst.element_size() == st.nbytes;
  if (src.device().type() == kTpu && src.device() != dst.device() && src.numel() > 0) {
    int device = dst.device().index();
    if (whole && src.scalar_type() == dst.scalar_type() && src.sizes().equals(dst.sizes())) {
      install_after_graph(st, copied_to_device(src, device));  // `.to("tpu:1")`: the copy is the storage
      return;
    }
    source = new_device_tensor(src.sizes(), std::nullopt, src.scalar_type(), device);  // then cast, broadcast
    install_buffer(storage_state(source.storage()), copied_to_device(src, device));
  }
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

}  // namespace torch_pjrt
