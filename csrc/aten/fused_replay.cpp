// Running a recorded fused graph's program again, without recording its ops:
// compiled replays (a torch.compile graph's later calls) and graph capture
// (torch.accelerator.Graph). Both reuse fused_graph.cpp's compile, donation and
// failed-check machinery (fused_graph_internal.h).

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>

#include "aten/fused_graph_internal.h"
#include "aten/growth.h"
#include "aten/host_copy.h"
#include "aten/profiling.h"
#include "graph/metrics.h"

// ---- replay of a compiled (torch.compile) graph ------------------------------
// A Dynamo/AOTAutograd graph records the same ops on every call with inputs of
// the same metadata (Dynamo's guards fix the op sequence). Its first call is
// recorded and run as usual; the plan then maps the program's parameters to
// the graph's inputs and its results to the graph's outputs, so later calls
// execute the compiled program directly, without dispatching or recording a
// single op. Anything the plan cannot map (a random op's fresh state, a CPU
// tensor operand, a storage that is not an input or output) means no plan.

namespace torch_pjrt {

using graph::metrics;
using namespace fused;

namespace {
struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  size_t nbytes = 0;  // of the storage
  int storage = 0;    // inputs: index of the first input sharing the storage; outputs: see ReplayOutput

  static TensorMeta of(const at::Tensor& t) {
    return TensorMeta{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type(), t.storage().nbytes(), 0};
  }
  bool same_view(const at::Tensor& t) const {
    return t.sizes().equals(sizes) && t.strides().equals(strides) && t.storage_offset() == offset &&
           t.scalar_type() == dtype && t.storage().nbytes() == nbytes;
  }
};

struct ReplayOutput {
  enum Kind { None, New, Input } kind = None;
  int index = 0;  // New: the live result; Input: the input whose storage it views
  TensorMeta meta;
};
}  // namespace

struct ReplayPlan {
  // The device its program was compiled for and its constant buffers live on:
  // inputs on another device take the recorded path (a program of their own).
  int device = -1;
  std::shared_ptr<CompiledGraph> compiled;
  std::vector<TensorMeta> inputs;
  std::vector<int> operand_input;               // per program parameter: the input it reads, or -1
  std::vector<pjrt::BufferPtr> operand_const;   // per parameter: the constant buffer (a Scalar), if no input
  std::vector<int64_t> operand_rng;             // per parameter: numbers a random op draws (a fresh state), or -1
  std::vector<std::pair<ElementType, std::vector<int64_t>>> operand_types;  // the program's parameter types
  std::vector<int> live_input;                  // per live result: the input storage it overwrites, or -1
  std::vector<char> live_read;                  // per live result: whether the program reads its old value
  std::vector<size_t> live_nbytes;              // per live result: the new storage's size
  std::vector<ReplayOutput> outputs;
  std::map<int, int> donated;                   // parameter -> result, as compiled
  std::vector<graph::SourceLocation> locations;  // per op, for runtime check messages
};

namespace {
bool device_tensor(const at::Tensor& t) { return t.defined() && t.device().type() == kTpu; }
// The device whose graph a compiled graph's inputs belong to (the current one if none is on tpu).
int graph_device(const std::vector<at::Tensor>& inputs) {
  for (const at::Tensor& t : inputs)
    if (device_tensor(t)) return t.get_device();
  return current_device();
}

// Per input, the index of the first input sharing its storage (itself if none). Hashed by
// storage: a compiled optimizer step has hundreds of inputs, so pairwise checks cost milliseconds.
std::vector<int> first_sharing(const std::vector<at::Tensor>& inputs) {
  std::unordered_map<const c10::StorageImpl*, int> first;
  first.reserve(inputs.size());
  std::vector<int> index(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    index[i] = first.emplace(inputs[i].storage().unsafeGetStorageImpl(), static_cast<int>(i)).first->second;
  return index;
}

// Inputs' metadata and which of them share a storage.
std::vector<TensorMeta> input_metas(const std::vector<at::Tensor>& inputs) {
  std::vector<int> sharing = first_sharing(inputs);
  std::vector<TensorMeta> metas;
  metas.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    metas.push_back(TensorMeta::of(inputs[i]));
    metas.back().storage = sharing[i];
  }
  return metas;
}

// The plan for the pending graph, built before it runs; null if it cannot replay.
thread_local std::string g_replay_refusal;  // why this thread's latest capture made no plan

std::shared_ptr<ReplayPlan> refuse(const std::string& why) {
  g_replay_refusal = why;
  return nullptr;
}

std::shared_ptr<ReplayPlan> plan_replay(PendingGraph& g, const std::vector<at::Tensor>& inputs,
                                        const std::vector<std::optional<at::Tensor>>& outputs,
                                        const std::vector<int>& live) {
  g_replay_refusal.clear();
  auto plan = std::make_shared<ReplayPlan>();
  for (const at::Tensor& t : inputs) {
    if (!device_tensor(t)) return refuse("an input is not a tpu tensor");
    if (t.get_device() != g.device) return refuse("an input is on another tpu device than the graph");
  }
  plan->device = g.device;
  plan->inputs = input_metas(inputs);
  auto input_of_storage = [&](const StorageState* st) {
    for (size_t i = 0; i < inputs.size(); ++i)
      if (&storage_state(inputs[i].storage()) == st) return static_cast<int>(i);
    return -1;
  };
  for (size_t k = 0; k < g.operands.size(); ++k) {
    if (!g.operands[k]) return refuse("an input storage was never written");  // a storage never written (reads as zeros)
    plan->operand_types.emplace_back(g.operands[k]->element_type(), g.operands[k]->dims());
    if (g.operand_kind[k] == OperandRef::Storage) {
      int input = input_of_storage(&storage_state(g.storages[g.operand_storage[k]]));
      if (input < 0) return refuse("the graph reads a storage that is not an input (a tensor made outside the graph)");  // a storage from outside the inputs (a module attribute)
      plan->operand_input.push_back(input);
      plan->operand_const.emplace_back();
      plan->operand_rng.push_back(-1);
    } else if (g.operand_kind[k] == OperandRef::Rng && g.operand_rng_count[k] >= 0) {
      // A random op: each replay draws a fresh state from the default generator,
      // in recording order, as running the graph op by op would.
      plan->operand_input.push_back(-1);
      plan->operand_const.emplace_back();
      plan->operand_rng.push_back(g.operand_rng_count[k]);
    } else if (g.operand_kind[k] == OperandRef::Scalar ||
               is_tensor_metadata(static_cast<OperandRef::Kind>(g.operand_kind[k]))) {
      // Cached per value: the same buffer every call. A storage offset (a stride,
      // a flat cat's positions) inside the graph follows from the inputs'
      // metadata, which replay checks.
      plan->operand_input.push_back(-1);
      plan->operand_const.push_back(g.operands[k]);
      plan->operand_rng.push_back(-1);
    } else {
      return refuse(g.operand_kind[k] == OperandRef::Rng ? "a random op with an explicit generator" : "a CPU tensor operand");  // a random state (fresh per call) or a CPU tensor (its value may change)
    }
  }
  std::unordered_map<const StorageState*, int> live_of;
  for (size_t k = 0; k < live.size(); ++k) {
    const c10::Storage& storage = g.storages[live[k]];
    live_of.emplace(&storage_state(storage), static_cast<int>(k));
    plan->live_input.push_back(input_of_storage(&storage_state(storage)));
    plan->live_nbytes.push_back(storage.nbytes());
  }
  plan->live_read = reads_old_value(g, live);
  for (const auto& out : outputs) {
    ReplayOutput r;
    if (out && out->defined()) {
      if (!device_tensor(*out)) return refuse("an output is not a tpu tensor");
      const StorageState* st = &storage_state(out->storage());
      r.meta = TensorMeta::of(*out);
      auto it = live_of.find(st);
      int input = input_of_storage(st);
      if (it != live_of.end() && plan->live_input[it->second] < 0) {
        r.kind = ReplayOutput::New;
        r.index = it->second;
      } else if (input >= 0) {
        r.kind = ReplayOutput::Input;  // an input or a view of one (updated in place if live)
        r.index = input;
      } else {
        return refuse("an output is neither computed by the graph nor an input");  // written by an earlier graph: nothing to map it to
      }
    }
    plan->outputs.push_back(std::move(r));
  }
  // Every live result must reach the caller as an output or an input's new value.
  for (size_t k = 0; k < live.size(); ++k) {
    if (plan->live_input[k] >= 0) continue;
    bool returned = false;
    for (const ReplayOutput& r : plan->outputs) returned |= r.kind == ReplayOutput::New && r.index == static_cast<int>(k);
    if (!returned) return refuse("the graph writes a storage that is neither an output nor an input");
  }
  for (const RecordedOp& op : g.ops) plan->locations.push_back(op.location);
  return plan;
}

std::vector<int> live_storages(const PendingGraph& g) {
  std::vector<int> live;
  for (size_t id = 0; id < g.storages.size(); ++id)
    if (g.written[id] && g.storages[id].use_count() > 1 + g.snapshot_refs[id]) live.push_back(static_cast<int>(id));
  return live;
}
}  // namespace

std::shared_ptr<ReplayPlan> run_and_capture(const std::vector<at::Tensor>& inputs,
                                            const std::vector<std::optional<at::Tensor>>& outputs) {
  check_not_forked();
  PendingGraph& g = pending_graph(graph_device(inputs));
  GraphLock lock(g);
  if (g.ops.empty()) return nullptr;
  // The key run_graph() gives this graph (same live set and donations).
  std::vector<int> live = live_storages(g);
  std::map<int, int> donated = donations(g, live);
  std::string key = program_key(g, live, donated, chains(g));
  std::shared_ptr<ReplayPlan> plan = plan_replay(g, inputs, outputs, live);
  run_graph(g);
  if (!plan) return nullptr;
  g_replay_refusal = "the program is not in the graph cache";
  DeviceContext& ctx = device_context(plan->device);
  std::lock_guard<std::mutex> cache_lock(ctx.graph_cache_mutex);
  auto it = ctx.graph_cache.find(key);
  if (it == ctx.graph_cache.end()) return nullptr;
  plan->compiled = it->second;
  plan->donated = std::move(donated);
  g_replay_refusal.clear();
  return plan;
}

std::optional<ExportedProgram> export_program(const std::vector<at::Tensor>& inputs,
                                              const std::vector<std::optional<at::Tensor>>& outputs) {
  check_not_forked();
  PendingGraph& g = pending_graph(graph_device(inputs));
  GraphLock lock(g);
  if (g.ops.empty()) return std::nullopt;
  std::vector<int> live = live_storages(g);
  std::shared_ptr<ReplayPlan> plan = plan_replay(g, inputs, outputs, live);
  if (!plan) {
    run_graph(g);
    return std::nullopt;
  }
  ExportedProgram e;
  e.checks = compile_graph(g, live, /*donated=*/{}, /*chained=*/false, &e.text)->checks != nullptr;
  for (size_t k = 0; k < plan->operand_input.size(); ++k) {
    ExportedProgram::Operand op;
    std::tie(op.type, op.dims) = plan->operand_types[k];
    if (plan->operand_input[k] >= 0) {
      op.input = plan->operand_input[k];
    } else if (plan->operand_rng[k] >= 0) {
      op.kind = ExportedProgram::Operand::Rng;
      op.rng_count = plan->operand_rng[k];
    } else {
      op.kind = ExportedProgram::Operand::Constant;
      op.bytes.resize(plan->operand_const[k]->byte_count());
      plan->operand_const[k]->to_host(op.bytes.data());
    }
    e.operands.push_back(std::move(op));
  }
  for (const ReplayOutput& r : plan->outputs) {
    ExportedProgram::Output out;
    out.kind = r.kind == ReplayOutput::New     ? ExportedProgram::Output::Result
               : r.kind == ReplayOutput::Input ? ExportedProgram::Output::Input
                                               : ExportedProgram::Output::None;
    out.index = r.index;
    out.sizes = r.meta.sizes;
    out.strides = r.meta.strides;
    out.offset = r.meta.offset;
    e.outputs.push_back(std::move(out));
  }
  run_graph(g);
  return e;
}

std::string replay_refusal() { return g_replay_refusal; }

namespace {
// The birth of the oldest input that the plan writes (UINT64_MAX: none); of
// a chained program, only among those it does not read (it keeps the others).
uint64_t oldest_input_born(const ReplayPlan& plan, const std::vector<at::Tensor>& inputs) {
  uint64_t oldest = UINT64_MAX;
  std::lock_guard<std::mutex> lock(storage_mutex());
  for (size_t k = 0; k < plan.live_input.size(); ++k) {
    int input = plan.live_input[k];
    if (input < 0) continue;  // a fresh output: nothing older to keep
    if (plan.compiled->chained && plan.live_read[k]) continue;
    const StorageState& st = storage_state(inputs[input].storage());
    if (st.buffer) oldest = std::min(oldest, st.born);
  }
  return oldest;
}
}  // namespace

std::optional<std::vector<std::optional<at::Tensor>>> replay(const ReplayPlan& plan,
                                                             const std::vector<at::Tensor>& inputs) {
  check_not_forked();
  if (inputs.size() != plan.inputs.size()) return std::nullopt;
  for (const at::Tensor& t : inputs)
    if (!device_tensor(t) || t.get_device() != plan.device) return std::nullopt;
  std::vector<int> sharing = first_sharing(inputs);
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!plan.inputs[i].same_view(inputs[i]) || sharing[i] != plan.inputs[i].storage) return std::nullopt;
  const int device = plan.device;
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  run_graph(g);  // the inputs' values, and the order of work before this call
  // After a failed check, the recorded path keeps older values (runtime_checks.h).
  if (checks_unread(device) && writes_dropped_before(device, oldest_input_born(plan, inputs))) return std::nullopt;
  std::vector<pjrt::BufferPtr> operands;
  operands.reserve(plan.operand_input.size());
  {
    std::lock_guard<std::mutex> storages(storage_mutex());
    for (size_t k = 0; k < plan.operand_input.size(); ++k) {
      if (plan.operand_input[k] < 0) {
        operands.push_back(plan.operand_const[k]);  // null for a random state: drawn below
        continue;
      }
      const StorageState& st = storage_state(inputs[plan.operand_input[k]].storage());
      if (!st.buffer || st.lost) return std::nullopt;  // no value: the recorded path raises or reads zeros
      // A storage's buffer may change type (a resize, a write through another dtype).
      if (st.buffer->element_type() != plan.operand_types[k].first || st.buffer->dims() != plan.operand_types[k].second)
        return std::nullopt;
      operands.push_back(st.buffer);
    }
    if (!plan.donated.empty() && !donations_unshared(operands, plan.donated)) return std::nullopt;
  }
  // Random states last: a refused replay must not advance the generator.
  draw_rng_states(operands, plan.operand_rng, device);
  if (plan.compiled->chained) operands.push_back(chained_status(device));
  std::vector<pjrt::Buffer*> raw;
  raw.reserve(operands.size());
  for (const auto& b : operands) raw.push_back(b.get());
  pjrt::ExecutablePtr exe = plan.compiled->program->executable();
  auto result = exe->execute(raw);
  const uint64_t program = begin_program(device);
  size_t live_count = plan.live_input.size();
  std::vector<c10::Storage> fresh(live_count);
  c10::DeviceGuard on_device(c10::Device(kTpu, static_cast<c10::DeviceIndex>(device)));
  c10::Allocator* allocator = c10::GetAllocator(kTpu);
  for (size_t k = 0; k < live_count; ++k) {
    if (plan.live_input[k] >= 0) {
      install_buffer(storage_state(inputs[plan.live_input[k]].storage()), result.outputs[k]);
    } else {
      // The allocator directly, not at::empty: a forward saves tens of activations per call.
      fresh[k] = c10::Storage(c10::Storage::use_byte_size_t(), plan.live_nbytes[k], allocator, /*resizable=*/true);
      install_buffer(storage_state(fresh[k]), result.outputs[k]);
    }
  }
  release_donated(operands, plan.donated);
  if (plan.compiled->checks) {
    std::vector<graph::SourceLocation> locations;
    for (size_t k : plan.compiled->checked_ops) locations.push_back(plan.locations[k]);
    defer_checks(device, program, result.outputs[live_count], plan.compiled->checks, std::move(locations));
  }
  ++metrics().executions;
  ++metrics().graphs;
  ++metrics().graph_cache_hits;
  ++metrics().compiled_replays;
  device_context(device).track(std::move(result.done), std::move(exe));
  static const c10::DispatchKeySet keys = at::empty({0}, at::TensorOptions().device(kTpu)).key_set();
  std::vector<std::optional<at::Tensor>> outs;
  outs.reserve(plan.outputs.size());
  for (const ReplayOutput& r : plan.outputs) {
    if (r.kind == ReplayOutput::None) {
      outs.emplace_back();
      continue;
    }
    c10::Storage storage = r.kind == ReplayOutput::New ? fresh[r.index] : inputs[r.index].storage();
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, c10::scalarTypeToTypeMeta(r.meta.dtype));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(r.meta.sizes, r.meta.strides, r.meta.offset);
    outs.push_back(std::move(t));
  }
  return outs;
}

}  // namespace torch_pjrt

// ---- graph capture (torch.accelerator.Graph) ---------------------------------
// CUDA graph semantics on a fused graph: between begin_capture and end_capture
// the device's ops are recorded as usual but never run; end_capture compiles
// them into one program, and each replay runs that program on the current
// values of the storages the ops read, writing the storages they wrote that
// are still referenced (a step's loss, gradients, parameters, optimizer
// state). Python does not run again: sizes, Scalars and control flow are
// those of the capture, and random ops draw a fresh state per replay.

namespace torch_pjrt {

struct CapturedGraph {
  int device = -1;
  PendingGraph recording;  // the captured ops; holds every storage they touch
  std::vector<int> live;   // recording storages the program writes, in result order
  std::map<int, int> donated;
  std::vector<std::pair<ElementType, std::vector<int64_t>>> operand_types;
  std::shared_ptr<CompiledGraph> compiled;   // donating the buffers `donated` names
  std::shared_ptr<CompiledGraph> undonated;  // compiled when a donated buffer has another owner
  std::string program_text;                  // kept when asked (debug_dump)
  // Per operand: a random op's generator offset relative to the capture's
  // start (-1: not random). A replay reserves `rng_span` numbers and gives
  // each op its base + relative offset, so states equal at capture (a
  // checkpoint's recomputation restores the state) stay equal in replays.
  std::vector<int64_t> rng_relative;
  uint64_t rng_span = 0;
  std::mutex mutex;
};

namespace {
// Moves the recorded ops out of `from`, which is left empty (storages keep their pending flags).
void move_recording(PendingGraph& from, PendingGraph& to) {
  to.device = from.device;
  to.ops = std::move(from.ops);
  to.compile_cost = from.compile_cost;
  to.operands = std::move(from.operands);
  to.operand_storage = std::move(from.operand_storage);
  to.operand_kind = std::move(from.operand_kind);
  to.operand_rng_count = std::move(from.operand_rng_count);
  to.operand_of_buffer = std::move(from.operand_of_buffer);
  to.operand_of_metadata = std::move(from.operand_of_metadata);
  to.storages = std::move(from.storages);
  to.ids = std::move(from.ids);
  to.written = std::move(from.written);
  to.has_value = std::move(from.has_value);
  to.extents = std::move(from.extents);
  to.snapshot_refs = std::move(from.snapshot_refs);
  to.inputs = std::move(from.inputs);
  to.key = std::move(from.key);
  to.has_checks = from.has_checks;
  to.run = std::move(from.run);
  reset_recording(from);
  from.run.reset();
}

// The captured ops never run: storages they wrote keep the value they had
// before the capture, and those without one (made inside it) raise `why` when read.
void settle_captured_storages(PendingGraph& r, const std::string& why) {
  auto message = std::make_shared<const std::string>(why);
  std::lock_guard<std::mutex> lock(storage_mutex());
  for (size_t id = 0; id < r.storages.size(); ++id) {
    if (!r.written[id]) continue;
    StorageState& st = storage_state(r.storages[id]);
    st.pending = false;
    if (!st.buffer && extent_bytes(st) > 0) st.lost = message;
  }
}

[[noreturn]] void discard_capture(CapturedGraph& cap, const std::string& message) {
  settle_captured_storages(cap.recording, "it was made inside a graph capture that failed: " + message);
  finish_run(cap.recording, nullptr, message);
  TORCH_CHECK(false, message);
}
}  // namespace

bool capturing(int device) { return pending_graph(device).capturing.load(); }

void begin_capture(int device) {
  check_not_forked();
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  TORCH_CHECK(!g.capturing, "capture_begin(): tpu:", device, " is already capturing a graph");
  run_graph(g);  // work recorded before the capture is not part of it
  // The process's mode is what the capture switches (and restores): a thread's own mode must be fused to record.
  TORCH_CHECK(thread_mode().value_or(Mode::Fused) == Mode::Fused, "capture_begin(): this thread runs in a mode of "
              "its own that is not fused (torch_pjrt.thread_mode); a capture records in fused mode");
  g.mode_before_capture = process_mode();
  g.rng_at_capture = next_rng_draw(std::nullopt, device, 0);  // a look, nothing drawn
  set_mode(Mode::Fused);  // strict and debug modes record too while capturing
  g.capturing = true;
  g.capture_failure.clear();
}

std::shared_ptr<CapturedGraph> end_capture(int device, bool keep_text) {
  check_not_forked();
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  TORCH_CHECK(g.capturing, "capture_end(): tpu:", device, " is not capturing a graph");
  g.capturing = false;
  set_mode(g.mode_before_capture);
  auto cap = std::make_shared<CapturedGraph>();
  cap->device = device;
  std::string failure = std::move(g.capture_failure);
  g.capture_failure.clear();
  move_recording(g, cap->recording);
  PendingGraph& r = cap->recording;
  if (!failure.empty()) discard_capture(*cap, "the graph capture on tpu:" + std::to_string(device) + " failed: " + failure);
  for (size_t k = 0; k < r.operands.size(); ++k) {
    if (r.operand_kind[k] == OperandRef::Rng && r.operand_rng_count[k] < 0)
      discard_capture(*cap, "a random op with an explicit generator cannot be captured in a graph: each replay "
                            "would repeat its numbers (use the default generator)");
    if (r.operand_kind[k] == OperandRef::Host)
      discard_capture(*cap, "an op of the captured graph reads a CPU tensor, whose later values a replay cannot "
                            "see: move it to tpu before the capture");
    if (!r.operands[k])
      discard_capture(*cap, "the captured graph reads a tpu tensor that was never written");
    cap->operand_types.emplace_back(r.operands[k]->element_type(), r.operands[k]->dims());
  }
  cap->rng_relative.assign(r.operands.size(), -1);
  const RngDraw start = g.rng_at_capture;
  uint64_t end_offset = next_rng_draw(std::nullopt, device, 0).offset;
  cap->rng_span = end_offset > start.offset ? end_offset - start.offset : 0;
  for (size_t k = 0; k < r.operands.size(); ++k) {
    if (r.operand_kind[k] != OperandRef::Rng) continue;
    uint64_t state[2];
    r.operands[k]->to_host(state);  // the (seed, offset) the op drew while recorded
    if (state[0] != start.seed || state[1] < start.offset)
      discard_capture(*cap, "the default generator was reseeded (manual_seed) or set to a state before the "
                            "capture's start (set_rng_state) inside the capture: a replay cannot repeat that");
    cap->rng_relative[k] = static_cast<int64_t>(state[1] - start.offset);
    uint64_t count = static_cast<uint64_t>(r.operand_rng_count[k]);
    cap->rng_span = std::max(cap->rng_span, state[1] - start.offset + rng_numbers_reserved(count));
  }
  cap->live = graph_results(r);
  cap->donated = donations(r, cap->live);
  try {
    if (!r.ops.empty())
      cap->compiled = compile_graph(r, cap->live, cap->donated, chains(r), keep_text ? &cap->program_text : nullptr);
  } catch (const OpFailure& e) {
    discard_capture(*cap, c10::str("a captured graph of ", r.ops.size(), " ops failed to compile at op ", e.op, ", ",
                                   describe(r.ops[e.op]), ", recorded at ",
                                   graph::describe_source_location(r.ops[e.op].location), ": ", e.what()));
  } catch (const std::exception& e) {
    discard_capture(*cap, c10::str("a captured graph of ", r.ops.size(), " ops failed to compile: ", e.what()));
  }
  settle_captured_storages(r, "it was made inside a graph capture and has no value before the graph's first replay()");
  // Replays read the storages' current buffers: drop the capture-time ones.
  for (size_t k = 0; k < r.operands.size(); ++k)
    if (r.operand_storage[k] >= 0) r.operands[k].reset();
  finish_run(r, nullptr, "");
  return cap;
}

void replay_captured(CapturedGraph& cap) {
  check_not_forked();
  PendingGraph& g = pending_graph(cap.device);
  GraphLock lock(g);
  TORCH_CHECK(!g.capturing, "replay(): tpu:", cap.device, " is capturing a graph; replay graphs after capture_end()");
  if (!cap.compiled) return;  // nothing was captured
  run_graph(g);  // work before the replay (new inputs copied into captured tensors) runs first
  std::lock_guard<std::mutex> replay_lock(cap.mutex);
  PendingGraph& r = cap.recording;
  // After a failed check whose error is unread, a replay would write only
  // tensors older than it: it writes nothing (runtime_checks.h).
  if (checks_unread(cap.device) &&
      writes_dropped_before(cap.device, oldest_born(r, cap.compiled->chained ? unread_rewrites(r, cap.live) : cap.live)))
    return;
  std::vector<pjrt::BufferPtr> operands(r.operands.size());
  bool donate = !cap.donated.empty();
  {
    std::lock_guard<std::mutex> storages(storage_mutex());
    for (size_t k = 0; k < operands.size(); ++k) {
      int id = r.operand_storage[k];
      if (id < 0) {
        operands[k] = r.operands[k];  // a Scalar or metadata (null for a random state: drawn below)
        continue;
      }
      const StorageState& st = storage_state(r.storages[id]);
      TORCH_CHECK(!st.lost, "replay(): a tensor the captured graph reads has no value: ", *st.lost);
      TORCH_CHECK(st.buffer, "replay(): a tensor the captured graph reads has no value (it was freed or never written)");
      TORCH_CHECK(st.buffer->element_type() == cap.operand_types[k].first && st.buffer->dims() == cap.operand_types[k].second,
                  "replay(): a tensor the captured graph reads changed its size or dtype since the capture (",
                  c10::str(cap.operand_types[k].second), " elements captured, ", c10::str(st.buffer->dims()),
                  " now); capture the graph again");
      operands[k] = st.buffer;
    }
    // Otherwise run the copy of the program that donates nothing.
    donate = donate && donations_unshared(operands, cap.donated);
  }
  std::shared_ptr<CompiledGraph> compiled = cap.compiled;
  if (!donate && !cap.donated.empty()) {
    if (!cap.undonated) cap.undonated = compile_graph(r, cap.live, {}, cap.compiled->chained);
    compiled = cap.undonated;
  }
  if (cap.rng_span > 0) {
    RngDraw base = next_rng_draw(std::nullopt, cap.device, cap.rng_span);
    for (size_t k = 0; k < operands.size(); ++k) {
      if (cap.rng_relative[k] < 0) continue;
      operands[k] = rng_state_buffer({base.seed, base.offset + static_cast<uint64_t>(cap.rng_relative[k])}, cap.device);
    }
  }
  if (compiled->chained) operands.push_back(chained_status(cap.device));
  std::vector<pjrt::Buffer*> raw;
  raw.reserve(operands.size());
  for (const auto& b : operands) raw.push_back(b.get());
  pjrt::ExecutablePtr exe = compiled->program->executable();
  auto result = exe->execute(raw);
  const uint64_t program = begin_program(cap.device);
  for (size_t k = 0; k < cap.live.size(); ++k) install_buffer(storage_state(r.storages[cap.live[k]]), result.outputs[k]);
  if (donate) release_donated(operands, cap.donated);
  if (compiled->checks) {
    std::vector<graph::SourceLocation> locations;
    for (size_t k : compiled->checked_ops) locations.push_back(r.ops[k].location);
    defer_checks(cap.device, program, result.outputs[cap.live.size()], compiled->checks, std::move(locations));
  }
  ++metrics().executions;
  ++metrics().graphs;
  ++metrics().graph_replays;
  device_context(cap.device).track(std::move(result.done), std::move(exe));
}

const std::string& captured_program_text(const CapturedGraph& cap) { return cap.program_text; }

bool step_may_fail(int device) {
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  return keep_values_on_failed_checks() && (!g.ops.empty() || checks_unread(device));
}

void restore_host_state_if_failed(int device, int64_t token) {
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  restore_if_failed(device, !g.ops.empty(), token);
}

void fail_capture(int device, const std::string& why) {
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  if (g.capturing && g.capture_failure.empty()) g.capture_failure = why;
}

}  // namespace torch_pjrt
