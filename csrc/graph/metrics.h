// Process-wide counters that explain where time goes: compiles, cache hits,
// executions, transfers and CPU fallbacks (per op). Any thread may update
// them: counters are atomics, the maps and lists go through the functions
// below (one mutex), and Python reads a consistent copy (metrics_snapshot).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pjrt::graph {

// A number any thread may add to. Copying reads it, so the whole Metrics
// struct can still be copied (a snapshot) and reset by assignment.
template <typename T>
class Counter {
 public:
  Counter() = default;
  Counter(const Counter& other) : value_(other.get()) {}
  Counter& operator=(const Counter& other) {
    value_.store(other.get(), std::memory_order_relaxed);
    return *this;
  }
  Counter& operator++() {
    value_.fetch_add(1, std::memory_order_relaxed);
    return *this;
  }
  Counter& operator+=(T delta) {
    value_.fetch_add(delta, std::memory_order_relaxed);
    return *this;
  }
  T get() const { return value_.load(std::memory_order_relaxed); }
  operator T() const { return get(); }

 private:
  std::atomic<T> value_{0};
};
using Count = Counter<int64_t>;
using Seconds = Counter<double>;

struct Metrics {
  Count compiles;
  Seconds compile_seconds;
  Count compile_cache_hits;  // program text already compiled (memory tier)
  Count disk_cache_hits;     // loaded from TORCH_PJRT_CACHE_DIR instead of compiling
  Count disk_cache_misses;
  Count disk_cache_writes;
  Count disk_cache_corrupt;  // entries that failed to verify (rebuilt)
  Count disk_cache_evictions;
  Count programs_unloaded;  // executables unloaded past TORCH_PJRT_MAX_LOADED_PROGRAMS (least recently used)
  Count programs_reloaded;  // unloaded programs loaded again (disk tier, else compiled: counted there too)
  Seconds disk_cache_load_seconds;  // reading and deserializing executables
  Seconds graph_lowering_seconds;   // fused graphs lowered to StableHLO (cache misses by structure)
  Count op_cache_hits;       // op signature seen before: no lowering at all
  Count op_cache_misses;
  Count executions;
  Count fused_ops;         // ops recorded into fused graphs
  Count graphs;            // fused graphs run
  Count graph_cache_hits;  // graphs found by structure, nothing lowered
  Count failing_op_searches;  // failed graph compiles whose error named no op: prefixes compiled to find it
  Count compiled_replays;  // torch.compile graphs run by replaying their program (no op dispatched)
  Count graph_replays;     // captured graphs (torch.accelerator.Graph) replayed
  Count donated_buffers;   // graph inputs whose buffer an in-place result reused
  Count donated_bytes;
  Count check_status_reads;  // runtime-check statuses read at host waits (one per checked program)
  Count host_to_device_bytes;
  Count collectives_in_xla;  // collectives run as one multi-device XLA program (aten/collectives.cpp)
  Count collective_bytes;    // their input bytes, summed over the participating devices
  Count device_to_host_bytes;
  Count device_to_device_bytes;  // copies between tpu devices, made by the plugin (no host round trip)
  // Guarded by metrics_mutex(): update through the functions below.
  std::map<std::string, int64_t> cpu_fallbacks;  // op name -> count
  std::map<std::string, std::vector<uint32_t>> cpu_fallback_lines;  // op name -> distinct user lines (SourceLocation)
  std::map<std::string, int64_t> lowered_ops;    // op name -> executions
  std::vector<std::string> recompile_reasons;    // fused graphs: why a graph compiled again (latest 50)
};

Metrics& metrics();
std::mutex& metrics_mutex();
void count_lowered_op(const std::string& name);
void count_cpu_fallback(const std::string& name, uint32_t location = 0);  // location: a graph::SourceLocation
void note_recompile_reason(std::string reason);
Metrics metrics_snapshot();
void reset_metrics();

}  // namespace torch_pjrt::graph
