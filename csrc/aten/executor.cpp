// The executor: one op call from the dispatcher to the device. run_lowered takes its steps in order (rewrite
// boolean masks, collect written arguments, decide growth, key, find or make the plan, shape written outputs,
// learn or compile the program) and then records the op into the fused graph or, in strict and debug modes,
// executes its own program here. The steps live in their files: op_signature (keys), op_planning (plans),
// growth (capacity storages), call_context (lowering), host_copy (transfers), cpu_fallback.
#include "aten/executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "aten/call_context.h"
#include "aten/cpu_fallback.h"
#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/exit_gate.h"
#include "aten/fused_graph.h"
#include "aten/growth.h"
#include "aten/host_copy.h"
#include "aten/op_call.h"
#include "aten/op_planning.h"
#include "aten/op_signature.h"
#include "aten/profiling.h"
#include "graph/metrics.h"
#include "graph/settings.h"
#include "graph/source_location.h"
#include "pjrt/error.h"

namespace torch_pjrt {

using graph::metrics;

namespace {

// ---- debug-mode checks ----

// Debug mode with TORCH_PJRT_CHECK_NANS=1: a NaN or Inf in a floating-point
// result raises at the op that made it.
void check_finite(const Call& call, const std::vector<at::Tensor>& outs) {
  static const bool enabled = graph::settings::flag("TORCH_PJRT_CHECK_NANS");
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
  device_context(call.device).track(std::move(result.done), std::move(exe));
  if (mode() == Mode::Debug) raise_failed_checks(call.device);  // debug waited for the program: raise at the op
  if (mode() == Mode::Debug) check_finite(call, outs);
  push_returns(stack, nargs, cached, outs);
  return true;
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

// A factory (no tpu tensor set the call's device): its device argument (torch.arange(n, device="tpu:1")),
// else the current one.
void choose_factory_device(Call& call) {
  if (call.device >= 0) return;
  for (const c10::IValue& v : call.args)
    if (v.isDevice() && v.toDevice().type() == kTpu && v.toDevice().has_index()) call.device = v.toDevice().index();
  if (call.device < 0) call.device = current_device();
}

// The plan cached under the call's key on its device, or one planned now and cached. Null (with *why) when the
// call cannot be planned: it runs on the CPU.
std::shared_ptr<CachedOp> find_or_plan(DeviceContext& ctx, Call& call, const lowering::LoweringEntry& entry,
                                       const OpKey& key, const Growth& growth, std::string* why) {
  std::shared_ptr<CachedOp> cached;
  {
    std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
    auto it = ctx.op_cache.find(key.key);
    if (it != ctx.op_cache.end()) cached = it->second;
  }
  if (cached && cached->exact_length > 0 && cached->exact_length != growth.length.length) cached = nullptr;  // plan again
  if (cached) {
    ++metrics().op_cache_hits;
    if (key.shared_storage && key.runtime_offset && !call.written.empty()) check_memory_overlap(call);
    return cached;
  }
  ++metrics().op_cache_misses;
  try {
    cached = plan(call, entry);
    plan_growth(call, *cached, growth);
  } catch (const lowering::Unsupported& e) {
    *why = e.what();
    return nullptr;
  } catch (const c10::NotImplementedError& e) {
    *why = "no meta kernel";
    return nullptr;
  } catch (const MetaRejected&) {
    *why = "its meta kernel rejects these arguments";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
  ctx.op_cache.insert_or_assign(key.key, cached);
  return cached;
}

// Fused modes learn the plan's operands, strict and debug compile its program, once per plan. Returns false
// (with *why) when lowering fails: the plan then always falls back.
bool prepare_program(DeviceContext& ctx, Call& call, CachedOp& cached, bool fused, std::string* why) {
  // The user's line for a recompile note: taken before the lock, as it takes the GIL.
  graph::SourceLocation location = !fused && !cached.program ? graph::capture_source_location() : 0;
  try {
    std::lock_guard<std::mutex> lock(ctx.op_cache_mutex);
    if (fused && !cached.operands_known) learn_operands(call, cached);
    if (!fused && !cached.program) compile_alone(call, cached, location);
  } catch (const lowering::Unsupported& e) {
    cached.unsupported = e.what();
  } catch (const pjrt::Error& e) {
    cached.unsupported = std::string("lowering failed: ") + e.what();
  }
  if (!cached.unsupported.empty()) {
    *why = cached.unsupported;
    return false;
  }
  return true;
}

}  // namespace

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
  if (!facts.entry) {
    *why = "no lowering";
    return false;
  }
  const lowering::LoweringEntry& entry = *facts.entry;
  size_t nargs = schema.arguments().size();
  Call call{op, schema, std::vector<c10::IValue>(stack->end() - nargs, stack->end()), {}, false, -1};
  if (!collect_written(call, facts, why)) return false;
  const Growth growth = growth_of(call, entry);
  std::optional<OpKey> key = op_key(call, facts, growth, why);
  if (!key) return false;
  choose_factory_device(call);
  check_host_indices(call);
  if (key->complex && !entry.complex) {
    *why = "no complex lowering";
    return false;
  }
  DeviceContext& ctx = device_context(call.device);  // plans hold programs compiled for this device
  std::shared_ptr<CachedOp> cached = find_or_plan(ctx, call, entry, *key, growth, why);
  if (!cached) return false;
  // Planned for its length only: a fused graph's signature holds it.
  if (cached->exact_length > 0) append_key_number(key->key, cached->exact_length);
  if (!cached->unsupported.empty()) {
    *why = cached->unsupported;
    return false;
  }
  shape_written_outputs(call, *cached);
  if (cached->outputs_empty) {  // XLA rejects some zero-sized windows and gathers
    push_returns(stack, nargs, *cached, output_tensors(call, *cached));
    return true;
  }
  bool fused = mode() == Mode::Fused || mode() == Mode::Lazy;
  if (!prepare_program(ctx, call, *cached, fused, why)) return false;
  bool ran = fused ? record(call, cached, stack, nargs, std::move(key->key)) : execute(call, *cached, stack, nargs);
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

}  // namespace torch_pjrt
