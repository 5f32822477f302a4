// One runtime context per device: everything whose meaning depends on the
// device lives here, not in process globals, so any number of devices work
// in one process, each with its own fused graph, from one thread or several.
#pragma once
#include <ATen/core/Generator.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "aten/runtime_checks.h"
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
};

// The run of a pending fused graph that an Event was recorded inside of
// (Event.record does not cut the graph). Filled under the graph's lock when
// the graph runs or fails; read after the event runs it (flush_through).
struct GraphRun {
  bool ran = false;
  std::shared_ptr<Work> work;  // its program; null if it completed synchronously
  std::string failure;         // why it failed ("" if it did not)
};

struct DeviceContext {
  explicit DeviceContext(int index);
  const int index;
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
  // The default generator (torch.tpu.manual_seed(seed) for this device).
  at::Generator generator;
  // Programs enqueued and not yet seen done (synchronize and events wait on them).
  std::mutex work_mutex;
  std::deque<std::shared_ptr<Work>> in_flight;
  // Runtime check statuses not yet read (runtime_checks.cpp).
  std::mutex checks_mutex;
  std::vector<PendingStatus> check_statuses;
  // Programs launched so far (begin_program), and the first one whose check
  // failed while its error is unread (0: none): writes to storages born
  // before it are dropped.
  std::atomic<uint64_t> programs{0};
  uint64_t failed_program = 0;
  std::vector<HostUndo> host_undos;  // under checks_mutex
};

// The context of device `index` (checked). Contexts live as long as the process.
DeviceContext& device_context(int index);
// Every device's context; empty while the runtime has not started.
std::vector<DeviceContext*> started_device_contexts();
// Made by fused_graph.cpp (where PendingGraph is complete).
std::shared_ptr<PendingGraph> make_pending_graph();

// Keeps a program's completion event (and its executable) in its device's in-flight list.
void track(int device, std::unique_ptr<pjrt::Event> done, pjrt::ExecutablePtr program);
// track() that returns the work (null in debug mode or without an event: it is done).
std::shared_ptr<Work> track_work(int device, std::unique_ptr<pjrt::Event> done, pjrt::ExecutablePtr program);
// The device's in-flight work now (an Event's snapshot).
std::vector<std::shared_ptr<Work>> in_flight_work(int device);
// Empties the device's in-flight list and returns it (synchronize waits on it).
std::deque<std::shared_ptr<Work>> take_in_flight(int device);

}  // namespace torch_pjrt
