// Fused and lazy modes: ops recorded into one XLA graph per flush (fused_graph.cpp).
// Everything that flushes, reads or replaces a storage a recorded graph may write goes through here.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/Storage.h>

#include <memory>
#include <optional>
#include <vector>
#include <string>

#include "pjrt/buffer.h"

namespace torch_pjrt {

struct Call;          // op_call.h
struct CachedOp;      // op_call.h
struct StorageState;  // device.h
struct GraphRun;      // device_context.h
struct Work;          // device_context.h

// Records the op instead of running it; pushes its (pending) outputs.
// Returns false (nothing recorded) when another thread changed an operand
// storage's type since the signature was taken: the caller plans again.
bool record(Call& call, const std::shared_ptr<CachedOp>& cached, torch::jit::Stack* stack, size_t nargs,
            std::string&& op_key);

// Fused and lazy modes: runs the recorded graphs of every device (or of
// `device`) now (asynchronously).
void flush_pending();
void flush_pending(int device);
// Event.record without cutting the graph: takes the device's in-flight work
// and, if ops of `streams` (a stream mask) are pending, the run of its pending
// graph that will cover them (null if none), both under the graph's lock.
std::shared_ptr<GraphRun> pending_graph_run(int device, uint64_t streams, std::vector<std::shared_ptr<Work>>& in_flight);
// Runs the device's pending graph if `run` is still its pending run; after it,
// run.ran is true.
void flush_through(int device, const GraphRun& run);
// The storage's buffer for a reader, after the recorded graph if it writes
// the storage. Taken under the graph's lock, so no graph donates it between
// the flush and the reference (a referenced buffer is never donated).
pjrt::BufferPtr readable_buffer(const StorageState& st);
// Gives the storage a whole new value, after the recorded graph if it writes
// the storage (under the graph's lock: no op records in between).
void install_after_graph(StorageState& st, pjrt::BufferPtr buffer);
// Sets a storage's byte size (tensor resize_, untyped_storage().resize_),
// after the recorded graph if it uses the storage: its ops were keyed and must
// be lowered at the old size. Size 0 frees the buffer (FSDP2 frees unsharded
// parameters so); growth keeps it (reads pad it with zeros up to the size).
void resize_storage_after_graph(const c10::Storage& storage, size_t nbytes);

// Whether this thread's recording cuts a fused graph at the op and
// compile-cost limits (default true). A torch.compile graph is recorded
// without those cuts: its replay needs it as one program. Returns the old value.
bool set_size_cuts(bool enabled);

// torch.compile graphs (see fused_graph.cpp, "replay"). After a compiled
// graph's ops were recorded (nothing else since the last cut): runs the graph
// and returns a plan that runs its program again on new inputs, or null.
struct ReplayPlan;
std::shared_ptr<ReplayPlan> run_and_capture(const std::vector<at::Tensor>& inputs,
                                            const std::vector<std::optional<at::Tensor>>& outputs);
// The graph's outputs computed from `inputs` by the plan's program alone;
// nullopt when the inputs differ from the captured ones (metadata, aliasing,
// buffer types) so the caller runs the graph op by op instead.
std::optional<std::vector<std::optional<at::Tensor>>> replay(const ReplayPlan& plan,
                                                             const std::vector<at::Tensor>& inputs);
// The pending graph as a portable program (torch_pjrt.export, docs/design/export.md): its module text
// (no donation, no earlier check status), what each parameter reads, where each output is. The graph then
// runs. Null, with replay_refusal() saying why, where the graph cannot be mapped to inputs and outputs.
struct ExportedProgram {
  struct Operand {
    enum Kind { Input, Constant, Rng } kind = Input;
    int input = -1;          // Input: the input it reads
    int64_t rng_count = -1;  // Rng: numbers a random op draws
    ElementType type = ElementType::F32;
    std::vector<int64_t> dims;
    std::string bytes;  // Constant: the buffer's bytes
  };
  struct Output {
    enum Kind { None, Result, Input } kind = None;
    int index = 0;  // Result: the live result; Input: the input whose storage it views
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
  };
  std::string text;
  std::vector<Operand> operands;
  bool checks = false;  // the program appends a runtime-check status result
  std::vector<Output> outputs;
};
std::optional<ExportedProgram> export_program(const std::vector<at::Tensor>& inputs,
                                              const std::vector<std::optional<at::Tensor>>& outputs);
// Why the latest run_and_capture() made no plan ("" if it made one).
std::string replay_refusal();

// Whether a step's programs on `device` may yet fail (a runtime check, or the
// pending graph's compile or run): ops are pending or a status is unread.
bool step_may_fail(int device);
// Restore `token` (host_restores.h) is due if the programs that ran or will
// run the ops recorded so far on `device` fail (its pending graph, if any, is
// the next program).
void restore_host_state_if_failed(int device, int64_t token);

// flush_pending() for the cut points (sync(), an optimizer step, the end of a
// module's inference call): skips a device that is capturing a graph.
void cut_pending();
// cut_pending() for each graph at least half as long (ops or compile cost) as the fused-mode limits, at a
// step boundary the caller saw (an outermost module call returned, a backward pass ended).
void cut_long_pending();

// Graph capture, torch.accelerator.Graph's semantics (fused_graph.cpp, "graph
// capture"): the device's ops between begin and end are recorded, compiled
// into one program and not run; replay_captured runs that program on the
// current values of what the ops read and writes what they wrote.
struct CapturedGraph;
bool capturing(int device);
void begin_capture(int device);
std::shared_ptr<CapturedGraph> end_capture(int device, bool keep_text);
void replay_captured(CapturedGraph& graph);
const std::string& captured_program_text(const CapturedGraph& graph);
// Marks the device's capture failed (a Python-side check): end_capture discards it and raises `why`.
void fail_capture(int device, const std::string& why);

}  // namespace torch_pjrt
