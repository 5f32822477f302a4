// One runtime context per device: everything whose meaning depends on the
// device lives here, not in process globals, so any number of devices work
// in one process, each with its own fused graph, from one thread or several.
#pragma once
#include <ATen/core/Generator.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "aten/host_restores.h"
#include "aten/runtime_checks.h"
#include "graph/source_location.h"
#include "pjrt/buffer.h"
#include "pjrt/event.h"
#include "pjrt/executable.h"

namespace torch_pjrt {

struct CachedOp;       // op_call.h
struct PendingGraph;   // fused_graph.cpp
struct CompiledGraph;  // fused_graph.cpp

// One program enqueued on the device, until it is known to be done. The
// plugin's completion callback stamps when it finished (Event timing).
struct Work {
  std::unique_ptr<pjrt::Event> done;
  // The program's executable, alive while it runs even if the compile cache unloads it.
  pjrt::ExecutablePtr program;
  // 0: not yet. Shared with the callback, which may outlive this Work.
  std::shared_ptr<std::atomic<int64_t>> finished_ns = std::make_shared<std::atomic<int64_t>>(0);
  // What must outlive the work besides its program (a non_blocking read's host tensor and buffer).
  std::shared_ptr<const void> holds;
  // The streams whose work this is (streams.h: a bit per stream id).
  uint64_t streams = 1;
};

// The run of a pending fused graph that an Event was recorded inside of
// (Event.record does not cut the graph). Filled under the graph's lock when
// the graph runs or fails; read after the event runs it (flush_through).
struct GraphRun {
  bool ran = false;
  std::shared_ptr<Work> work;  // its program; null if it completed synchronously
  std::string failure;         // why it failed ("" if it did not)
};

// What torch_pjrt.explain() compares a recompile with: the graphs and op
// signatures compiled before on the same device (two devices' programs are
// not each other's history).
struct SeenGraph {
  std::vector<std::string> keys, descriptions, details;
  std::vector<std::vector<std::vector<int64_t>>> sizes;
};
struct RecompileHistory {
  SeenGraph last;                       // fused: the last graph compiled
  std::map<size_t, SeenGraph> by_length;  // fused: the last one of each length (loops alternate graphs)
  // strict/debug: the last signature compiled per op and user line
  std::map<std::pair<std::string, graph::SourceLocation>, std::string> op_signatures;
};

// The runtime of one device: its caches, its pending graph, its work in
// flight, its check statuses and its recompile history. Code that acts on a
// device takes its context (device_context(index)) and calls these methods.
class DeviceContext {
 public:
  explicit DeviceContext(int index);
  const int index;

  // ---- work in flight: programs enqueued and not yet seen done
  // Keeps a program's completion event (and its executable) until it is done.
  // It is the calling thread's current stream's work.
  void track(std::unique_ptr<pjrt::Event> done, pjrt::ExecutablePtr program) {
    track_work(std::move(done), std::move(program));
  }
  // track() that returns the work (null in debug mode or without an event: it is done). `streams`:
  // the streams whose ops it carries (a stream mask, streams.h); 0: the current stream.
  std::shared_ptr<Work> track_work(std::unique_ptr<pjrt::Event> done, pjrt::ExecutablePtr program,
                                   uint64_t streams = 0);
  // The work in flight now (an Event's snapshot).
  std::vector<std::shared_ptr<Work>> in_flight_work();
  // Empties the in-flight list and returns it (synchronize waits on it).
  std::deque<std::shared_ptr<Work>> take_in_flight();
  // A program that failed after its launch (out of memory while running) is
  // raised once: at a read of its results, or else at synchronize(). The
  // launch of an unrelated later op never raises it.
  // Why the first such program no read reported failed ("" if none); clears it.
  std::string take_unreported_failure();
  // A read raised a device error: the failures finished so far are that one's.
  void failures_reported();

  // ---- recompile history (torch_pjrt.explain()): `fn` runs under its lock.
  template <typename Fn>
  auto with_recompile_history(Fn&& fn) {
    std::lock_guard<std::mutex> lock(recompile_mutex_);
    return fn(recompile_history_);
  }

  // Op plans: a plan holds an executable compiled for this device, so the
  // signature key alone is unambiguous inside one context.
  std::mutex op_cache_mutex;
  std::unordered_map<std::string, std::shared_ptr<CachedOp>> op_cache;
  // Device buffers of Scalar operands (host_copy.cpp's cached_scalar_buffer).
  std::mutex scalar_mutex;
  std::unordered_map<std::string, std::shared_ptr<pjrt::Buffer>> scalar_buffers;
  // Fused/lazy modes: the graph being recorded and the compiled graphs.
  std::shared_ptr<PendingGraph> graph;
  std::mutex graph_cache_mutex;
  std::unordered_map<std::string, std::shared_ptr<CompiledGraph>> graph_cache;
  // Round-robin positions in the normal and high-priority stream pools (streams.cpp).
  std::atomic<uint32_t> next_pool_stream[2] = {0, 0};
  // The default generator (torch.tpu.manual_seed(seed) for this device).
  at::Generator generator;
  // Runtime check statuses not yet read (runtime_checks.cpp).
  std::mutex checks_mutex;
  std::vector<PendingStatus> check_statuses;
  // Programs launched so far (begin_program), and the first one whose check
  // failed while its error is unread (0: none): writes to storages born
  // before it are dropped.
  std::atomic<uint64_t> programs{0};
  uint64_t failed_program = 0;
  std::vector<HostUndo> host_undos;  // under checks_mutex (host_restores.h)
  // Chained statuses (runtime_checks.h): set once a program with checks ran;
  // a passed status on this device, made when first chained.
  std::atomic<bool> checks_seen{false};
  pjrt::BufferPtr passed_status;  // under checks_mutex

 private:
  std::mutex work_mutex_;
  std::deque<std::shared_ptr<Work>> in_flight_;
  std::string unreported_failure_;  // under work_mutex_
  void pop_finished_work();  // under work_mutex_
  std::mutex recompile_mutex_;
  RecompileHistory recompile_history_;
};

// The context of device `index` (checked). Contexts live as long as the process.
DeviceContext& device_context(int index);
// Every device's context; empty while the runtime has not started.
std::vector<DeviceContext*> started_device_contexts();
// Made by fused_graph.cpp (where PendingGraph is complete).
std::shared_ptr<PendingGraph> make_pending_graph();

}  // namespace torch_pjrt
