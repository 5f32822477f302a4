// Fused graphs (fused and lazy modes).
//
// Ops are recorded instead of run. Each recorded op keeps a snapshot of its
// arguments (tensor metadata as it was), and the graph resolves every operand
// that is not a storage at record time. At a flush the graph runs as one
// program whose outputs are the storages it wrote that are still referenced
// outside it; dead intermediates stay inside. The graph's key (the ops'
// signatures plus how storages flow between them) finds a compiled program
// without lowering anything again.

#include "aten/fused_graph.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <map>
#include <unordered_map>
#include <optional>
#include <stdexcept>
#include <mutex>
#include <thread>
#include <tuple>

#include "aten/device_context.h"
#include "aten/fused_graph_internal.h"
#include "aten/growth.h"
#include "aten/host_copy.h"
#include "aten/host_restores.h"
#include "aten/op_call.h"
#include "aten/profiling.h"
#include "aten/streams.h"
#include "graph/metrics.h"
#include "graph/settings.h"
#include "graph/source_location.h"

namespace torch_pjrt {
namespace {

using graph::metrics;

}  // namespace

std::shared_ptr<PendingGraph> make_pending_graph() { return std::make_shared<PendingGraph>(); }

namespace fused {

PendingGraph& pending_graph(int device) { return *device_context(device).graph; }

int storage_id(PendingGraph& g, const c10::Storage& storage) {
  const StorageState* st = &storage_state(storage);
  auto [it, fresh] = g.ids.emplace(st, static_cast<int>(g.storages.size()));
  if (fresh) {
    g.storages.push_back(storage);
    g.written.push_back(0);
    g.has_value.push_back(0);
    g.extents.push_back(extent_bytes(*st));
    g.snapshot_refs.push_back(0);
  }
  return it->second;
}

// A tensor with `t`'s metadata and storage that later metadata changes to `t`
// (resize_, set_, transpose_) cannot reach.
at::Tensor snapshot_tensor(PendingGraph& g, const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kTpu) return t;
  auto snap = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  snap.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  ++g.snapshot_refs[storage_id(g, t.storage())];
  return snap;
}

// key += v, without a temporary string (keys grow by a few numbers per recorded op).
void append_number(std::string& key, int64_t v) {
  char digits[24];
  key.append(digits, std::to_chars(digits, digits + sizeof digits, v).ptr);
}

c10::IValue snapshot_value(PendingGraph& g, const c10::IValue& v, std::string& key) {
  return map_tensors(v, [&](const at::Tensor& t) {
    if (t.defined() && t.device().type() == kTpu) {
      append_number(key, storage_id(g, t.storage()));
      key += ',';
    }
    return snapshot_tensor(g, t);
  });
}

void mark_written(PendingGraph& g, const at::Tensor& t) {
  int id = storage_id(g, t.storage());
  g.written[id] = g.has_value[id] = 1;
  StorageState& st = storage_state(t.storage());
  std::lock_guard<std::mutex> lock(storage_mutex());
  st.pending = true;
  st.lost.reset();
  st.pending_element = element_or_throw(t.scalar_type());
  st.pending_count = static_cast<int64_t>(extent_bytes(st) / t.element_size());
}

void finish_run(PendingGraph& g, std::shared_ptr<Work> work, std::string failure) {
  if (!g.run) return;
  g.run->ran = true;
  g.run->work = std::move(work);
  g.run->failure = std::move(failure);
  g.run.reset();
}

size_t graph_op_limit() {
  static const size_t limit = static_cast<size_t>(graph::settings::integer("TORCH_PJRT_FUSION_LIMIT", 1));
  return limit;
}

thread_local bool t_size_cuts = true;

size_t graph_cost_limit() {
  static const size_t limit = static_cast<size_t>(graph::settings::integer("TORCH_PJRT_FUSION_COST", 1));
  return limit;
}

// A graph operand for a buffer that is not a storage, once however often it recurs: the op's operand id.
int add_buffer_operand(PendingGraph& g, const Call& call, const OperandRef& ref, pjrt::BufferPtr buffer) {
  const int next = static_cast<int>(g.operands.size());
  int id = next;
  bool fresh = true;
  if (is_tensor_metadata(ref.kind)) {
    const StorageState* owner = &storage_state(item_tensor(call.args[ref.arg], ref.item).storage());
    auto found = g.operand_of_metadata.emplace(std::make_tuple(buffer.get(), static_cast<int>(ref.kind), owner), next);
    id = found.first->second;
    fresh = found.second;
  } else {
    auto found = g.operand_of_buffer.emplace(buffer.get(), next);
    id = found.first->second;
    fresh = found.second;
  }
  if (fresh) {
    g.operands.push_back(std::move(buffer));
    g.operand_storage.push_back(-1);
    // A 0-d CPU tensor is a number in the op (a wrapped `x / 2.0`):
    // constant for replay, as a Scalar is.
    // While capturing, only a Python number is: a 0-d CPU tensor (a
    // learning rate a scheduler changes) must not be fixed in replays.
    const at::Tensor& host = ref.kind == OperandRef::Host ? item_tensor(call.args[ref.arg], ref.item) : at::Tensor();
    bool number = host.defined() && host.dim() == 0 &&
                  (!g.capturing || host.unsafeGetTensorImpl()->is_wrapped_number());
    g.operand_kind.push_back(number ? OperandRef::Scalar : ref.kind);
    bool default_rng = ref.kind == OperandRef::Rng &&
                       !(ref.arg >= 0 && call.args[ref.arg].isGenerator() && call.args[ref.arg].toGenerator().defined());
    g.operand_rng_count.push_back(default_rng ? static_cast<int64_t>(ref.count) : -1);
  }
  return id;
}

// A storage the op reads becomes a graph parameter, unless an earlier op wrote it or already made it one.
void add_storage_operand(PendingGraph& g, const Call& call, const OperandRef& ref) {
  const c10::Storage& storage = item_tensor(call.args[ref.arg], ref.item).storage();
  int id = storage_id(g, storage);
  if (g.has_value[id]) return;  // an earlier op wrote it, or it is already a parameter
  g.has_value[id] = 1;
  pjrt::BufferPtr buffer = buffer_of(storage_state(storage));
  g.inputs.inputs.emplace(&storage_state(storage), lowering::TensorType{buffer->element_type(), buffer->dims()});
  g.operands.push_back(std::move(buffer));
  g.operand_storage.push_back(id);
  g.operand_kind.push_back(OperandRef::Storage);
  g.operand_rng_count.push_back(-1);
}

// The op's operands added to the graph, in its lowering's order; returns the graph operand id of each one that
// is not a storage. `resolved` holds those buffers. The key says which operand each op uses, so graphs
// that share operands differently never share a program.
std::vector<int> add_operands(PendingGraph& g, const Call& call, const CachedOp& cached,
                              std::vector<pjrt::BufferPtr>& resolved, std::string& operand_key) {
  std::vector<int> operand_ids;
  for (size_t i = 0; i < cached.operands.size(); ++i) {
    const OperandRef& ref = cached.operands[i];
    if (ref.kind == OperandRef::Storage) {
      add_storage_operand(g, call, ref);
      continue;
    }
    const int id = add_buffer_operand(g, call, ref, std::move(resolved[i]));
    operand_ids.push_back(id);
    operand_key += 'p';
    append_number(operand_key, id);
    operand_key += ',';
  }
  return operand_ids;
}

}  // namespace fused

using namespace fused;

bool record(Call& call, const std::shared_ptr<CachedOp>& cached, torch::jit::Stack* stack, size_t nargs,
            std::string&& op_key) {
  // Before the graph's lock: the capture takes the GIL, and a Python thread
  // holding the GIL may be waiting for that lock.
  graph::SourceLocation location = graph::capture_source_location();
  PendingGraph& g = pending_graph(call.device);  // each device records its own graph
  GraphLock lock(g);
  // An op on another stream than the graph's ops cuts the graph (fused mode): a copy or collective issued on a
  // side stream is then its own program, which starts when its inputs are ready instead of inside the compute
  // graph around it. Lazy mode cuts only where the user reads or marks a step.
  const uint64_t stream = stream_bit(current_stream(call.device));
  if (mode() == Mode::Fused && !g.capturing && g.streams && !(g.streams & stream)) run_graph(g);
  {
    std::lock_guard<std::mutex> storages(storage_mutex());
    if (!storages_as_keyed(call)) return false;  // another thread wrote a storage first: plan again
  }
  // What can raise runs before the graph changes (a Scalar its operand's type
  // cannot hold: addcdiv_(..., value=1j) on a float tensor; a host copy; an
  // output's allocation or dtype). Raising halfway through the loop below
  // left the storages it had read as operands that no recorded op lowers, so
  // the graph's program took fewer parameters than the graph then supplied.
  std::vector<pjrt::BufferPtr> resolved(cached->operands.size());
  for (size_t i = 0; i < cached->operands.size(); ++i)
    if (cached->operands[i].kind != OperandRef::Storage) resolved[i] = operand_buffer(call, cached->operands[i]);
  std::vector<at::Tensor> outs = output_tensors(call, *cached);
  for (const at::Tensor& t : outs)
    if (t.defined()) element_or_throw(t.scalar_type());  // mark_written's
  g.device = call.device;
  g.streams |= stream;
  // Operands in the order the op's lowering asks for them (see emit()).
  std::string operand_key;
  std::vector<int> operand_ids = add_operands(g, call, *cached, resolved, operand_key);
  RecordedOp rec{call.op, cached, std::move(op_key), {}, std::move(call.written), call.returns_written, {}, location,
                 std::move(operand_ids), std::move(call.keyed_storages)};
  rec.key += '@';
  rec.args.reserve(call.args.size());
  for (const c10::IValue& v : call.args) rec.args.push_back(snapshot_value(g, v, rec.key));
  rec.key += operand_key;
  g.key += rec.key;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].defined()) continue;
    mark_written(g, outs[i]);
    if (!cached->outputs[i].write) rec.new_storages.push_back(&storage_state(outs[i].storage()));
  }
  g.key += ';';
  g.ops.push_back(std::move(rec));
  g.compile_cost += cached->compile_cost;
  g.has_checks = g.has_checks || cached->checks != nullptr;
  ++metrics().fused_ops;
  graph::count_lowered_op(op_name(call.schema));
  push_returns(stack, nargs, *cached, outs);
  if (mode() == Mode::Fused && t_size_cuts && !g.capturing &&
      (g.ops.size() >= graph_op_limit() || g.compile_cost >= graph_cost_limit()))
    run_graph(g);
  return true;
}

namespace fused {

// The runtime checks of a graph's ops, in op order.
struct GraphChecks {
  std::vector<lowering::RuntimeCheck> checks;
  std::vector<CheckInfo> infos;
  std::vector<size_t> ops;  // graph op index per checked op
};

// Lowers the first `count` ops into `b`. Returns every op's results, in order.
std::vector<Value> emit_ops(PendingGraph& g, lowering::Builder& b, GraphValues& values, size_t count,
                            GraphChecks* checks = nullptr) {
  values.inputs = g.inputs.inputs;
  std::vector<Value> produced;
  for (size_t k = 0; k < count; ++k) {
    RecordedOp& rec = g.ops[k];
    Call call{rec.op, rec.op.schema(), rec.args, rec.written, rec.returns_written, g.device};
    call.keyed_storages = rec.keyed_storages;
    std::vector<Value> flats;
    values.operand_ids = &rec.operand_ids;
    values.next_operand = 0;
    std::vector<lowering::RuntimeCheck> op_checks;
    hlo::Location where = op_location(rec.op.schema(), rec.location);
    where.graph_op = static_cast<int64_t>(k);
    b.set_location(std::move(where));  // alias k: the text above the locations does not depend on them
    try {
      flats = emit_op(b, call, *rec.cached, &values, &op_checks);
    } catch (const std::exception& e) {
      throw OpFailure(k, e.what());
    }
    if (checks && !op_checks.empty()) {
      add_check_infos(checks->infos, op_checks, describe_call(rec.op.schema(), rec.args), checks->ops.size());
      checks->ops.push_back(k);
      checks->checks.insert(checks->checks.end(), op_checks.begin(), op_checks.end());
    }
    size_t next_flat = 0, next_new = 0;
    for (const OutputPlan& p : rec.cached->outputs) {
      if (p.absent) continue;
      const StorageState* st = p.write ? &storage_state(item_tensor(call.args[p.arg], p.item).storage()) : rec.new_storages[next_new++];
      values.values.insert_or_assign(st, flats[next_flat++]);
    }
    produced.insert(produced.end(), flats.begin(), flats.end());
  }
  values.operand_ids = nullptr;
  return produced;
}

// The op a compile error names by its location (the StableHLO verifier
// reports the op's line and, as a call site, its index in the graph).
std::optional<size_t> op_named_by_error(const PendingGraph& g, const std::string& error) {
  for (size_t k = 0; k < g.ops.size(); ++k)
    if (error.find(hlo::graph_op_location_mark(static_cast<int64_t>(k))) != std::string::npos) return k;
  return std::nullopt;
}

// After the whole graph failed to compile and its error named no single op:
// the first op whose prefix of the graph fails too (binary search over
// prefixes that return every value).
// Error path only: compiles about log2(ops) programs, none of them cached.
std::optional<size_t> first_op_failing_to_compile(PendingGraph& g) {
  ++metrics().failing_op_searches;
  size_t good = 0, bad = g.ops.size();  // prefix of `good` ops compiles, of `bad` ops fails
  while (bad - good > 1) {
    size_t mid = good + (bad - good) / 2;
    lowering::Builder b;
    GraphValues values;
    bool compiles = true;
    try {
      client().compile(b.finish(emit_ops(g, b, values, mid)), compile_cache().options(graph::Effort::Full), g.device);
    } catch (const std::exception&) {
      compiles = false;
    }
    (compiles ? good : bad) = mid;
  }
  if (bad == 0) return std::nullopt;
  return bad - 1;
}

// A small graph (few ops, small tensors: a test's or a script's first steps)
// compiles at the lower optimization level strict mode gives small ops: about
// half the compile time, microseconds more to run (benchmarks/bench_compile.py).
graph::Effort graph_effort(const PendingGraph& g, const lowering::Builder& b, const std::vector<Value>& outputs) {
  constexpr size_t kQuickOps = 32;
  constexpr int64_t kQuickElements = int64_t{1} << 16;
  if (g.ops.size() > kQuickOps) return graph::Effort::Full;
  int64_t largest = 0;
  for (const lowering::TensorType& t : b.parameters()) largest = std::max(largest, t.element_count());
  for (const Value& v : outputs) largest = std::max(largest, v.type.element_count());
  return largest <= kQuickElements ? graph::Effort::Quick : graph::Effort::Full;
}

// A graph whose checks fail, or that chains an earlier failure, writes
// nothing: each result that replaces a value the graph read is selected on
// `ok`, so parameters and optimizer state updated after a bad index keep
// their values (runtime_checks.h). In an update XLA fuses the select into the
// loop that already reads the old value.
void keep_values_on_failed_check(const PendingGraph& g, lowering::Builder& b, Value ok, const GraphValues& values,
                                 const std::vector<int>& live, std::vector<Value>& outputs) {
  for (size_t k = 0; k < live.size(); ++k) {
    auto old = values.originals.find(&storage_state(g.storages[live[k]]));
    if (old == values.originals.end() || old->second.type != outputs[k].type) continue;
    outputs[k] = b.select(b.broadcast_in_dim(ok, outputs[k].dims(), {}), outputs[k], old->second);
  }
}

// Whether the program of `g` chains its device's statuses (runtime_checks.h).
bool chains(const PendingGraph& g) {
  return keep_values_on_failed_checks() && (g.has_checks || chains_statuses(g.device));
}

// `chained`: the program's last parameter is an earlier program's status (chained_status).
std::shared_ptr<CompiledGraph> compile_graph(PendingGraph& g, const std::vector<int>& live,
                                             const std::map<int, int>& donated, bool chained,
                                             std::string* text) {
  auto start = std::chrono::steady_clock::now();
  lowering::Builder b;
  GraphValues values;
  GraphChecks checks;
  emit_ops(g, b, values, g.ops.size(), &checks);
  // Run with g.operands as its arguments: a mismatch is this file's bug, named here rather than by the plugin.
  if (b.parameters().size() != g.operands.size())
    throw std::logic_error("internal: a fused graph's program takes " + std::to_string(b.parameters().size()) +
                           " parameters but the graph holds " + std::to_string(g.operands.size()) + " operands");
  std::vector<Value> outputs;
  for (int id : live) outputs.push_back(values.values.at(&storage_state(g.storages[id])));
  auto compiled = std::make_shared<CompiledGraph>();
  compiled->chained = chained;
  if (chained || !checks.checks.empty()) b.set_location({"torch_pjrt::runtime_checks", "", 0});
  std::optional<Value> earlier_ok;
  if (chained) {
    Value earlier = b.parameter(lowering::TensorType{ElementType::S64, {3}});
    Value index = b.reshape(b.slice(earlier, {0}, {1}, {1}), {});
    earlier_ok = b.compare(index, b.constant_int(-1, ElementType::S64), hlo::Compare::EQ);
  }
  std::optional<Value> ok = earlier_ok;
  for (const lowering::RuntimeCheck& c : checks.checks) ok = ok ? b.binary("and", *ok, c.ok) : c.ok;
  if (ok && keep_values_on_failed_checks()) keep_values_on_failed_check(g, b, *ok, values, live, outputs);
  if (!checks.checks.empty()) {
    outputs.push_back(lowering::check_status(b, checks.checks, earlier_ok));
    compiled->checks = std::make_shared<const std::vector<CheckInfo>>(std::move(checks.infos));
    compiled->checked_ops = std::move(checks.ops);
  }
  std::string program = b.finish(outputs, donated);
  if (text) *text = program;
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  metrics().graph_lowering_seconds += took.count();
  try {
    compiled->program = compile_cache().get_or_compile(program, g.device, graph_effort(g, b, outputs));
  } catch (const std::exception& e) {
    if (auto op = op_named_by_error(g, e.what())) throw OpFailure(*op, e.what());
    if (auto op = first_op_failing_to_compile(g)) throw OpFailure(*op, e.what());
    throw;
  }
  return compiled;
}

// "aten::add.Tensor(f32[3, 4], f32[4])": what a recompile explanation shows.
std::string describe(const RecordedOp& rec) { return describe_call(rec.op.schema(), rec.args); }

// What a key holds beyond the shapes, for an explanation: per tpu tensor
// argument its strides ("contiguous": the key has none), whether its offset
// is a runtime operand, and its storage's size in bytes.
std::string layout_detail(const RecordedOp& rec) {
  std::string text;
  for (const c10::IValue& v : rec.args) {
    map_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kTpu) return t;
      text += text.empty() ? "" : "; ";
      text += t.is_contiguous() ? std::string("contiguous") : "strides " + c10::str(t.strides());
      if (t.storage_offset() != 0) text += ", runtime offset";
      text += ", storage of " + std::to_string(t.storage().nbytes()) + " bytes";
      if (size_t capacity = storage_state(t.storage()).capacity) text += " (capacity " + std::to_string(capacity) + ")";
      return t;
    });
  }
  return text;
}

// The sizes of an op's tpu tensor arguments, in argument order.
std::vector<std::vector<int64_t>> tensor_sizes(const RecordedOp& rec) {
  std::vector<std::vector<int64_t>> sizes;
  for (const c10::IValue& v : rec.args) {
    map_tensors(v, [&](const at::Tensor& t) {
      if (t.defined() && t.device().type() == kTpu) sizes.push_back(t.sizes().vec());
      return t;
    });
  }
  return sizes;
}

// "; its input 0 has sizes [12, 4], before [8, 4] (batch size 8 -> 12)": the
// first tensor whose sizes changed, and the one dimension that did when only one did.
std::string changed_input(const std::vector<std::vector<int64_t>>& now,
                          const std::vector<std::vector<int64_t>>& before) {
  for (size_t i = 0; i < now.size() && i < before.size(); ++i) {
    if (now[i] == before[i]) continue;
    std::string text = "; its input " + std::to_string(i) + " has sizes " + c10::str(c10::IntArrayRef(now[i])) +
                       ", before " + c10::str(c10::IntArrayRef(before[i]));
    if (now[i].size() != before[i].size()) return text;
    std::vector<size_t> dims;
    for (size_t d = 0; d < now[i].size(); ++d)
      if (now[i][d] != before[i][d]) dims.push_back(d);
    if (dims.size() != 1) return text;
    size_t d = dims[0];
    std::string what = d == 0 ? "batch size" : "dim " + std::to_string(d);
    return text + " (" + what + " " + std::to_string(before[i][d]) + " -> " + std::to_string(now[i][d]) + ")";
  }
  return "";
}

// Recompilation explainer: says how a graph that missed the cache differs
// from the graph compiled before it on the same device (its context keeps
// the history), and at which user line.
std::string recompile_reason(const PendingGraph& g, const SeenGraph& now, const SeenGraph& before) {
  const std::vector<std::string>& keys = now.keys;
  const std::vector<std::string>& last_keys = before.keys;
  size_t k = 0;
  while (k < keys.size() && k < last_keys.size() && keys[k] == last_keys[k]) ++k;
  if (k < keys.size() && k < last_keys.size()) {
    std::string reason = "op " + std::to_string(k) + " (" + graph::describe_source_location(g.ops[k].location) +
                         ") is " + now.descriptions[k] + " where the previous graph had " + before.descriptions[k] +
                         changed_input(now.sizes[k], before.sizes[k]);
    if (now.descriptions[k] == before.descriptions[k] && now.details[k] != before.details[k])
      reason += " (same shapes; its tensors: " + now.details[k] + ", before: " + before.details[k] + ")";
    else if (now.descriptions[k] == before.descriptions[k])
      reason += " (same shapes: strides, aliasing, tensor flow or which Scalars are equal differ)";
    return reason;
  }
  if (keys.size() != last_keys.size()) {
    std::string reason = "the previous graph had " + std::to_string(last_keys.size()) + " ops, this one " +
                         std::to_string(keys.size()) + " (the first " + std::to_string(k) + " are the same)";
    if (k < keys.size()) reason += "; op " + std::to_string(k) + " at " + graph::describe_source_location(g.ops[k].location);
    return reason;
  }
  return "same ops; a different set of results is still in use";
}

void explain_recompile(const PendingGraph& g) {
  SeenGraph now;
  for (const RecordedOp& rec : g.ops) {
    now.keys.push_back(rec.key);
    now.descriptions.push_back(describe(rec));
    now.details.push_back(layout_detail(rec));
    now.sizes.push_back(tensor_sizes(rec));
  }
  device_context(g.device).with_recompile_history([&](RecompileHistory& h) {
    // Compared with the last compiled graph of the same length when there is
    // one: loops alternate graphs (a decode step's forward, then its sampling).
    auto same_length = h.by_length.find(now.keys.size());
    const SeenGraph& before = same_length != h.by_length.end() ? same_length->second : h.last;
    if (!before.keys.empty())
      graph::note_recompile_reason("graph of " + std::to_string(now.keys.size()) + " ops recompiled: " +
                                   recompile_reason(g, now, before));
    if (h.by_length.size() > 256) h.by_length.clear();
    h.by_length[now.keys.size()] = now;
    h.last = std::move(now);
  });
}

// Profiler record of a graph: "torch_pjrt::execute(12 ops: aten::mm, ...)" and every op's signature.
std::pair<std::string, std::string> graph_profile(const PendingGraph& g, const char* kind) {
  std::string name = std::string("torch_pjrt::") + kind + "(" + std::to_string(g.ops.size()) + " ops: ";
  std::string ops;
  for (size_t k = 0; k < g.ops.size(); ++k) {
    if (k < 3) name += std::string(k ? ", " : "") + g.ops[k].op.schema().name();
    ops += (k ? "; " : "") + describe(g.ops[k]);
  }
  return {name + (g.ops.size() > 3 ? ", ...)" : ")"), ops};
}

// Empties the graph's recording (its storages keep their pending flags).
void reset_recording(PendingGraph& g) {
  g.ops.clear();
  g.compile_cost = 0;
  g.operands.clear();
  g.operand_storage.clear();
  g.operand_kind.clear();
  g.operand_rng_count.clear();
  g.operand_of_buffer.clear();
  g.operand_of_metadata.clear();
  g.storages.clear();
  g.ids.clear();
  g.written.clear();
  g.has_value.clear();
  g.extents.clear();
  g.snapshot_refs.clear();
  g.inputs.inputs.clear();
  g.key.clear();
  g.has_checks = false;
  g.streams = 0;
  g.device = -1;
}

void clear_graph(PendingGraph& g) {
  {
    std::lock_guard<std::mutex> lock(storage_mutex());
    for (size_t id = 0; id < g.storages.size(); ++id)
      if (g.written[id]) storage_state(g.storages[id]).pending = false;
  }
  reset_recording(g);
}

// The program's results: written storages that something besides the graph
// still holds and that were not freed since (see resize_storage_after_graph).
std::vector<int> graph_results(const PendingGraph& g) {
  std::vector<int> live;
  for (size_t id = 0; id < g.storages.size(); ++id) {
    if (g.written[id] && g.storages[id].use_count() > 1 + g.snapshot_refs[id] &&
        extent_bytes(storage_state(g.storages[id])) > 0) {
      live.push_back(static_cast<int>(id));
    }
  }
  return live;
}

// Donation: a storage the graph reads and then overwrites (a parameter or an
// optimizer state updated in place) gives its input buffer to its output, so
// a step does not hold old and new values at once. Only buffers nothing else
// holds are donated (the storage and the graph's operand list: two owners),
// and only when the new value has the old buffer's type. Maps operand index
// to output index.
std::map<int, int> donations(const PendingGraph& g, const std::vector<int>& live) {
  std::map<int, int> donated;
  std::unordered_map<int, int> output_of;
  for (size_t k = 0; k < live.size(); ++k) output_of.emplace(live[k], static_cast<int>(k));
  for (size_t k = 0; k < g.operands.size(); ++k) {
    int id = g.operand_storage[k];
    if (id < 0 || !g.written[id]) continue;
    auto out = output_of.find(id);
    if (out == output_of.end()) continue;
    const StorageState& st = storage_state(g.storages[id]);
    const pjrt::BufferPtr& buffer = g.operands[k];
    std::lock_guard<std::mutex> lock(storage_mutex());  // readers take references under it
    if (st.buffer != buffer || buffer.use_count() != 2) continue;
    if (buffer->element_type() != st.pending_element || buffer->dims() != std::vector<int64_t>{st.pending_count})
      continue;
    donated.emplace(static_cast<int>(k), out->second);
  }
  return donated;
}

// Whether a failed program kept the donated buffer `b`. A plugin holds a
// donated buffer as deleted while the program is pending and hands it back
// when the program fails before using it, a moment after it reports the
// failure (the CPU plugin's worker thread does), so it is asked again for a
// while before the buffer is taken for consumed.
static bool donation_consumed(pjrt::Buffer* b) {
  if (!b) return true;
  auto deleted = [b] {
    try {
      return b->is_deleted();
    } catch (const std::exception&) {
      return true;
    }
  };
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (deleted()) {
    if (std::chrono::steady_clock::now() > give_up) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// A failed graph is undone: recording never replaces a storage's buffer, so
// every storage it was to write still holds the buffer it had before the
// graph, and parameters and optimizer state read as before the failed step.
// Storages with no value before the graph (made inside it) keep the error and
// raise it when used, and so does any storage whose donated input buffer the
// plugin consumed despite the failure (never a stale or zero value).
[[noreturn]] void fail_graph(PendingGraph& g, const std::string& message, const std::map<int, int>& donated,
                             uint64_t program) {
  restore_failed_program(g.device, program);  // run as the lock is released
  auto lost = std::make_shared<const std::string>(message);
  std::vector<char> consumed(g.storages.size(), 0);
  for (auto [operand, output] : donated)
    if (donation_consumed(g.operands[operand].get())) consumed[g.operand_storage[operand]] = 1;
  {
    std::lock_guard<std::mutex> lock(storage_mutex());
    for (size_t id = 0; id < g.storages.size(); ++id) {
      StorageState& st = storage_state(g.storages[id]);
      if (g.written[id] && extent_bytes(st) > 0 && (!st.buffer || consumed[id])) st.lost = lost;
    }
  }
  clear_graph(g);
  finish_run(g, nullptr, message);
  raise_device_error(message);
}

// The operands a program consumed (donated), to the background thread that destroys their handles.
void release_donated(std::vector<pjrt::BufferPtr>& operands, const std::map<int, int>& donated) {
  std::vector<pjrt::BufferPtr> spent;
  spent.reserve(donated.size());
  for (auto [operand, output] : donated) spent.push_back(std::move(operands[operand]));
  release_spent(std::move(spent));
}

// Whether each donated operand's buffer has no owner besides its storage and
// `operands` (a tensor sharing it would see it consumed). Under storage_mutex().
bool donations_unshared(const std::vector<pjrt::BufferPtr>& operands, const std::map<int, int>& donated) {
  std::vector<const pjrt::Buffer*> in_list;  // sorted: counted by binary search (no map per call)
  in_list.reserve(operands.size());
  for (const auto& b : operands) in_list.push_back(b.get());
  std::sort(in_list.begin(), in_list.end());
  for (auto [operand, output] : donated) {
    const pjrt::BufferPtr& b = operands[operand];
    auto [first, last] = std::equal_range(in_list.begin(), in_list.end(), b.get());
    if (b.use_count() != (last - first) + 1) return false;
  }
  return true;
}

// A replayed program's random states: a fresh draw from the default generator
// per operand that has a count (in operand order, as running the ops would).
void draw_rng_states(std::vector<pjrt::BufferPtr>& operands, const std::vector<int64_t>& counts, int device) {
  for (size_t k = 0; k < counts.size(); ++k) {
    if (counts[k] < 0) continue;
    operands[k] = rng_state_buffer(next_rng_draw(std::nullopt, device, static_cast<uint64_t>(counts[k])), device);
  }
}

// While a device captures, nothing may move values between the host and its
// tensors: the captured ops have not run, and a value read (or written) now
// would be baked into every replay. Raising also discards the capture.
void check_not_capturing(PendingGraph& g, int device) {
  if (!g.capturing) return;
  std::string message = c10::str(
      "tpu:", device, " is capturing a graph (torch.accelerator.Graph): the captured ops do not run until replay(), "
      "and a value moved between the host and the device now would be fixed in every replay, so this cannot be "
      "captured (reading a value with .item(), .cpu() or print, an op that falls back to the CPU, a copy from host "
      "memory, a resize, synchronize(), a collective). Move it out of the capture");
  if (g.capture_failure.empty()) g.capture_failure = message;
  TORCH_CHECK(false, message);
}

// The birth of the oldest of these storages that has a value (UINT64_MAX: none).
uint64_t oldest_born(const PendingGraph& g, const std::vector<int>& ids) {
  uint64_t oldest = UINT64_MAX;
  std::lock_guard<std::mutex> lock(storage_mutex());
  for (int id : ids) {
    const StorageState& st = storage_state(g.storages[id]);
    if (st.buffer) oldest = std::min(oldest, st.born);
  }
  return oldest;
}

// Per result among `live`: whether the graph reads the storage's old value
// (it is an operand). A chained program keeps those values itself; one it
// writes without reading first (a zero_, a whole copy_) it cannot.
std::vector<char> reads_old_value(const PendingGraph& g, const std::vector<int>& live) {
  std::vector<char> operand(g.storages.size(), 0);
  for (int id : g.operand_storage)
    if (id >= 0) operand[id] = 1;
  std::vector<char> read;
  for (int id : live) read.push_back(operand[id]);
  return read;
}

// The results among `live` that the graph writes without reading them first.
std::vector<int> unread_rewrites(const PendingGraph& g, const std::vector<int>& live) {
  std::vector<char> read = reads_old_value(g, live);
  std::vector<int> unread;
  for (size_t k = 0; k < live.size(); ++k)
    if (!read[k]) unread.push_back(live[k]);
  return unread;
}

// After a failed check whose error is unread, the graph's results that
// replace older values are left out: those storages keep their buffers
// (runtime_checks.h). Reads the unread statuses first only when the graph
// writes such a storage and does not chain them (a chained program keeps the
// values it reads itself; the host knows a failure only once it read it).
void keep_values_after_failed_check(const PendingGraph& g, std::vector<int>& live, bool chained) {
  if (!checks_unread(g.device)) return;
  uint64_t before = writes_dropped_before(g.device, oldest_born(g, chained ? unread_rewrites(g, live) : live));
  if (!before) return;
  std::lock_guard<std::mutex> lock(storage_mutex());
  live.erase(std::remove_if(live.begin(), live.end(), [&](int id) {
    const StorageState& st = storage_state(g.storages[id]);
    return st.buffer && st.born < before;
  }), live.end());
}

// The compiled-graph cache's key of `g` run with these results and donations.
std::string program_key(const PendingGraph& g, const std::vector<int>& live, const std::map<int, int>& donated,
                        bool chained) {
  std::string key = g.key + "|live:";
  for (int id : live) key += std::to_string(id) + ",";
  if (!keep_values_on_failed_checks()) key += "|unkept";  // a program without the selects (benchmarks)
  if (chained) key += "|chained";
  key += "|donate:";
  for (auto [operand, output] : donated) key += std::to_string(operand) + ">" + std::to_string(output) + ",";
  return key;
}

void run_graph(PendingGraph& g) {
  if (g.ops.empty()) return;
  check_not_capturing(g, g.device);
  std::vector<int> live = graph_results(g);
  const bool chained = chains(g);
  keep_values_after_failed_check(g, live, chained);
  std::map<int, int> donated = donations(g, live);
  std::string key = program_key(g, live, donated, chained);
  size_t op_count = g.ops.size();
  DeviceContext& ctx = device_context(g.device);
  // Set by a successful run; tracked after the try: tracking may raise an
  // earlier program's failure, which must not be taken for this graph's.
  std::unique_ptr<pjrt::Event> done;
  pjrt::ExecutablePtr exe;
  const int device = g.device;  // clear_graph resets it
  const uint64_t streams = g.streams;
  uint64_t program = current_program(device) + 1;  // its number once launched
  try {
    std::shared_ptr<CompiledGraph> compiled;
    {
      std::lock_guard<std::mutex> lock(ctx.graph_cache_mutex);
      auto it = ctx.graph_cache.find(key);
      if (it != ctx.graph_cache.end()) compiled = it->second;
    }
    if (compiled) {
      ++metrics().graph_cache_hits;
    } else {
      explain_recompile(g);
      ProfileScope profile([&] { return graph_profile(g, "compile"); });
      compiled = compile_graph(g, live, donated, chained);
      std::lock_guard<std::mutex> lock(ctx.graph_cache_mutex);
      ctx.graph_cache.emplace(std::move(key), compiled);
    }
    std::vector<pjrt::Buffer*> buffers;
    for (const auto& b : g.operands) buffers.push_back(b.get());
    pjrt::BufferPtr earlier_status = compiled->chained ? chained_status(g.device) : nullptr;
    if (earlier_status) buffers.push_back(earlier_status.get());
    // The first run of a new graph (new shapes: the likeliest to run out of
    // memory) waits for completion while every input buffer is still held, so
    // a failure the plugin reports asynchronously is still undone here.
    bool first_run = !compiled->ran_once.load();
    ProfileScope profile([&] { return graph_profile(g, "execute"); });
    exe = compiled->program->executable();
    auto result = exe->execute(buffers);
    program = begin_program(g.device);
    if ((first_run || profile.active()) && result.done) {
      result.done->wait();
      compiled->ran_once = true;
    }
    for (size_t k = 0; k < live.size(); ++k) install_buffer(storage_state(g.storages[live[k]]), result.outputs[k]);
    if (compiled->checks) {
      std::vector<graph::SourceLocation> locations;
      for (size_t k : compiled->checked_ops) locations.push_back(g.ops[k].location);
      defer_checks(g.device, program, result.outputs[live.size()], compiled->checks, std::move(locations));
    }
    for (auto [operand, output] : donated) {
      ++metrics().donated_buffers;
      metrics().donated_bytes += static_cast<int64_t>(result.outputs[output]->byte_count());
    }
    release_donated(g.operands, donated);
    ++metrics().executions;
    ++metrics().graphs;
    done = std::move(result.done);
    clear_graph(g);
  } catch (const OpFailure& e) {
    std::string op = describe(g.ops[e.op]), where = graph::describe_source_location(g.ops[e.op].location);
    fail_graph(g, c10::str("a fused graph of ", op_count, " ops failed at op ", e.op, ", ", op, ", recorded at ",
                           where, ": ", e.what()), donated, program);
  } catch (const std::exception& e) {
    std::string first = graph::describe_source_location(g.ops.front().location);
    std::string last = graph::describe_source_location(g.ops.back().location);
    fail_graph(g, c10::str("a fused graph of ", op_count, " ops, recorded from ", first, " to ", last, ", failed: ",
                           e.what()), donated, program);
  }
  std::shared_ptr<Work> work;
  try {
    work = device_context(device).track_work(std::move(done), std::move(exe), streams);
  } catch (...) {
    finish_run(g, nullptr, "");  // this graph ran; the error is an earlier program's
    throw;
  }
  finish_run(g, std::move(work), "");
}

}  // namespace fused

bool set_size_cuts(bool enabled) {
  bool old = t_size_cuts;
  t_size_cuts = enabled;
  return old;
}

void flush_pending(int device) {
  check_not_forked();  // before the lock: a thread of the parent may have held it at the fork
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  run_graph(g);
}

std::shared_ptr<GraphRun> pending_graph_run(int device, uint64_t streams,
                                            std::vector<std::shared_ptr<Work>>& in_flight) {
  check_not_forked();
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  in_flight = device_context(device).in_flight_work();
  if (g.ops.empty() || !(g.streams & streams)) return nullptr;
  if (!g.run) g.run = std::make_shared<GraphRun>();
  return g.run;
}

void flush_through(int device, const GraphRun& run) {
  check_not_forked();
  PendingGraph& g = pending_graph(device);
  GraphLock lock(g);
  if (g.run.get() == &run) run_graph(g);
}

void flush_pending() {
  check_not_forked();
  for (DeviceContext* ctx : started_device_contexts()) flush_pending(ctx->index);
}

void cut_pending() {
  check_not_forked();
  for (DeviceContext* ctx : started_device_contexts()) {
    PendingGraph& g = pending_graph(ctx->index);
    GraphLock lock(g);
    if (!g.capturing) run_graph(g);
  }
}

// A loop with nothing read and no cut point (gradcheck's forward per perturbed element, with autograd on,
// and its backward per output element) used to be cut only at the op limit, at a different op each time:
// every graph was new and compiled for seconds. Cutting at a boundary once the graph is half the limit
// makes each graph the same whole number of iterations, so the loop repeats a cached program.
void cut_long_pending() {
  check_not_forked();
  if (mode() != Mode::Fused || !t_size_cuts) return;
  for (DeviceContext* ctx : started_device_contexts()) {
    PendingGraph& g = pending_graph(ctx->index);
    GraphLock lock(g);
    if (!g.capturing && (2 * g.ops.size() >= graph_op_limit() || 2 * g.compile_cost >= graph_cost_limit()))
      run_graph(g);
  }
}

namespace {
bool is_pending(const StorageState& st) {
  std::lock_guard<std::mutex> lock(storage_mutex());
  return st.pending;
}
}  // namespace

pjrt::BufferPtr readable_buffer(const StorageState& st) {
  PendingGraph& g = pending_graph(st.device);
  GraphLock lock(g);
  check_not_capturing(g, st.device);  // even a value written before the capture
  if (is_pending(st)) run_graph(g);
  return buffer_of(st);
}

void install_after_graph(StorageState& st, pjrt::BufferPtr buffer) {
  PendingGraph& g = pending_graph(st.device);
  GraphLock lock(g);
  check_not_capturing(g, st.device);
  if (is_pending(st)) run_graph(g);
  install_buffer(st, std::move(buffer));
}

// FSDP2 frees each group's unsharded parameters (resize_(0)) after their
// forward ops were recorded, and reallocates them at the same size before the
// next all-gather writes them. Neither needs the pending graph to run: its ops
// are lowered at their recorded extents, it holds the buffers it reads as
// operands, and a storage freed by the time it runs is no output. Its value
// after a reallocation is unspecified (resize_'s new bytes), here the last
// value the graph gave it. Any other resize of a storage the graph touches
// (growing it, a capacity storage) runs the graph first.
void resize_storage_after_graph(const c10::Storage& storage, size_t nbytes) {
  StorageState& st = storage_state(storage);
  if (!runtime_started()) return set_storage_bytes(storage, nbytes);  // no graph can hold it yet
  PendingGraph& g = pending_graph(st.device);
  GraphLock lock(g);
  if (auto it = g.ids.find(&st); it != g.ids.end()) {
    bool free = nbytes == 0 && st.capacity == 0;
    bool reallocate = st.nbytes == 0 && st.capacity == 0 && nbytes == g.extents[it->second];
    if (!free && !reallocate) run_graph(g);
  }
  set_storage_bytes(storage, nbytes);
  if (nbytes == 0) {
    {
      std::lock_guard<std::mutex> storages(storage_mutex());
      st.pending = false;  // no value to wait for
    }
    install_buffer(st, nullptr);
  }
}

}  // namespace torch_pjrt
