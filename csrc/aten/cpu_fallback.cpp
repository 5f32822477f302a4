// The CPU fallback: an op the device does not run (no lowering, or one that refuses these arguments) runs on
// the CPU with PyTorch's own fallback, or, when a written tensor shares its storage with another argument, on
// host views that keep the aliasing. Apart from the executor so its path reads as one decision: lowered, or here.
#include "aten/cpu_fallback.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUFallback.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include "aten/device.h"
#include "aten/fused_graph.h"
#include "aten/op_call.h"
#include "graph/metrics.h"
#include "graph/source_location.h"

namespace torch_pjrt {

namespace {

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

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why) {
  check_written_on_device(op.schema(), *stack);
  flush_pending();
  try {
    if (written_shares_storage(op.schema(), *stack)) cpu_fallback_aliased(op, stack);
    else at::native::cpu_fallback(op, stack);
  } catch (const c10::NotImplementedError& e) {
    // The op has no CPU kernel (a CUDA-only one): say why it could not run on
    // tpu, instead of the dispatcher's error about the CPU backend.
    std::string cpu = e.what_without_backtrace();
    if (cpu.find("'CPU' backend") == std::string::npos) throw;
    TORCH_CHECK_NOT_IMPLEMENTED(false, "torch_pjrt: ", op_name(op.schema()), " cannot run on tpu with these arguments (",
                                why, ") and PyTorch has no CPU kernel for it to fall back to");
  }
  // Counted once it ran: when the CPU kernel raises (a shape error the meta
  // kernel saw first), that is the user's error, not an op running on the CPU.
  note_cpu_fallback(op_name(op.schema()), why);
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

}  // namespace torch_pjrt
