// What fused_graph.cpp (recording and running graphs) shares with
// fused_replay.cpp (running a recorded graph's program again: compiled replays
// and graph capture). Private to those two files.
#pragma once
#include <ATen/ATen.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "aten/device_context.h"
#include "aten/fused_graph.h"
#include "aten/host_restores.h"
#include "aten/op_call.h"
#include "graph/source_location.h"

namespace torch_pjrt {

struct RecordedOp {
  c10::OperatorHandle op;
  std::shared_ptr<CachedOp> cached;
  std::string key;  // the op's signature and which graph storages it touches
  std::vector<c10::IValue> args;
  std::vector<int> written;
  bool returns_written;
  std::vector<const StorageState*> new_storages;  // per new (non-written) output
  graph::SourceLocation location;                 // the user's line that recorded it
  std::vector<int> operand_ids;                   // graph operand index of each non-storage operand
  std::vector<KeyedStorage> keyed_storages;       // its storages as recorded (lowered at these extents)
};

// One device's graph being recorded (its DeviceContext owns it).
struct PendingGraph {
  std::recursive_mutex mutex;
  int device = -1;
  std::vector<RecordedOp> ops;
  size_t compile_cost = 0;  // the ops' lowerings' Builder::compile_cost, summed (a cut point)
  std::vector<pjrt::BufferPtr> operands;  // in the order the program's parameters appear
  std::vector<int> operand_storage;       // per operand: the storage id it is the buffer of, or -1
  std::vector<int> operand_kind;          // per operand: its OperandRef::Kind (replay needs Scalars only)
  // Per operand: numbers a random op draws from the device's default
  // generator (replay draws a fresh state of that size); -1 if none or drawn
  // from an explicit generator.
  std::vector<int64_t> operand_rng_count;
  std::unordered_map<const pjrt::Buffer*, int> operand_of_buffer;  // non-storage operands, each buffer once
  // A tensor's runtime offset, stride or flat cat position/length: once per
  // (value, kind, storage). Two storages' offsets that happen to be equal at
  // one step and not the next (a growing sequence's and a rotary table's)
  // must not change the program's parameters.
  std::map<std::tuple<const pjrt::Buffer*, int, const StorageState*>, int> operand_of_metadata;
  std::vector<c10::Storage> storages;     // every storage touched, alive until the graph runs
  std::unordered_map<const StorageState*, int> ids;
  std::vector<char> written, has_value;
  std::vector<size_t> extents;     // per storage: its extent when first touched (a free does not change it)
  std::vector<int> snapshot_refs;  // storage references held by the graph's own snapshots
  GraphValues inputs;              // record-time types of storages read before written
  std::string key;
  bool has_checks = false;  // an op declared runtime checks
  uint64_t streams = 0;     // the streams its ops were recorded on (streams.h)
  std::shared_ptr<GraphRun> run;   // events recorded inside this graph (null: none)
  // torch.accelerator.Graph capture ("graph capture" below): the ops recorded
  // are kept for replay and never run here; why the capture failed, if it did.
  std::atomic<bool> capturing{false};  // read without the lock (a Python query per compiled call)
  std::string capture_failure;
  Mode mode_before_capture = Mode::Fused;
  RngDraw rng_at_capture{0, 0};  // the default generator's state when the capture began
};

// A graph's lock. Its release is where host restores due to a failed graph run
// (host_restores.h): they are Python code, which must not run under the lock.
class GraphLock {
 public:
  explicit GraphLock(PendingGraph& g) : mutex_(g.mutex) {
    mutex_.lock();
    enter_graph_lock();
  }
  ~GraphLock() {
    mutex_.unlock();
    leave_graph_lock();
  }
  GraphLock(const GraphLock&) = delete;
  GraphLock& operator=(const GraphLock&) = delete;

 private:
  std::recursive_mutex& mutex_;
};

struct CompiledGraph {
  graph::ProgramPtr program;
  std::atomic<bool> ran_once{false};  // a run of it completed without error
  // Runtime checks of all ops, one status after the live outputs (null: none).
  CheckInfos checks;
  std::vector<size_t> checked_ops;  // graph op index per CheckInfo::op
  // Takes the device's newest unread status as its last parameter (runtime_checks.h).
  bool chained = false;
};

namespace fused {

// The device's graph being recorded.
PendingGraph& pending_graph(int device);
// Runs the recorded ops as one program; on an error the graph fails, its storages as before it.
void run_graph(PendingGraph& g);
// Tells the events recorded inside the graph that it ran (or failed).
void finish_run(PendingGraph& g, std::shared_ptr<Work> work, std::string failure);
// Empties the graph's recording (its storages keep their pending flags).
void reset_recording(PendingGraph& g);
std::string describe(const RecordedOp& rec);

// An error inside a graph, pinned to the recorded op it came from.
struct OpFailure : std::runtime_error {
  OpFailure(size_t op, const std::string& what) : std::runtime_error(what), op(op) {}
  size_t op;
};

// The program of `g` whose results are the `live` storages (`text`: its module text, if asked).
std::shared_ptr<CompiledGraph> compile_graph(PendingGraph& g, const std::vector<int>& live,
                                             const std::map<int, int>& donated, bool chained,
                                             std::string* text = nullptr);
// Whether the graph's program takes the device's newest unread status (runtime_checks.h).
bool chains(const PendingGraph& g);
std::string program_key(const PendingGraph& g, const std::vector<int>& live, const std::map<int, int>& donated,
                        bool chained);
// The written storages something besides the graph still holds, in result order.
std::vector<int> graph_results(const PendingGraph& g);

// Donation: the parameters the program may consume (parameter -> result).
std::map<int, int> donations(const PendingGraph& g, const std::vector<int>& live);
void release_donated(std::vector<pjrt::BufferPtr>& operands, const std::map<int, int>& donated);
bool donations_unshared(const std::vector<pjrt::BufferPtr>& operands, const std::map<int, int>& donated);
// A fresh random state for each random op's operand.
void draw_rng_states(std::vector<pjrt::BufferPtr>& operands, const std::vector<int64_t>& counts, int device);

// Failed checks (runtime_checks.h): the oldest birth among storages `ids`; per live result whether the
// program reads its old value; the live results it overwrites without reading them.
uint64_t oldest_born(const PendingGraph& g, const std::vector<int>& ids);
std::vector<char> reads_old_value(const PendingGraph& g, const std::vector<int>& live);
std::vector<int> unread_rewrites(const PendingGraph& g, const std::vector<int>& live);

}  // namespace fused
}  // namespace torch_pjrt
