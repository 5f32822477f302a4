// Process-wide counters that explain where time goes: compiles, cache hits,
// executions, transfers and CPU fallbacks (per op).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace torch_pjrt::graph {

struct Metrics {
  int64_t compiles = 0;
  double compile_seconds = 0;
  int64_t compile_cache_hits = 0;  // program text already compiled (memory tier)
  int64_t disk_cache_hits = 0;     // loaded from TORCH_PJRT_CACHE_DIR instead of compiling
  int64_t disk_cache_misses = 0;
  int64_t disk_cache_writes = 0;
  int64_t disk_cache_corrupt = 0;  // entries that failed to verify (rebuilt)
  int64_t disk_cache_evictions = 0;
  double disk_cache_load_seconds = 0;  // reading and deserializing executables
  double graph_lowering_seconds = 0;   // fused graphs lowered to StableHLO (cache misses by structure)
  int64_t op_cache_hits = 0;       // op signature seen before: no lowering at all
  int64_t op_cache_misses = 0;
  int64_t executions = 0;
  int64_t fused_ops = 0;         // ops recorded into fused graphs
  int64_t graphs = 0;            // fused graphs run
  int64_t graph_cache_hits = 0;  // graphs found by structure, nothing lowered
  int64_t donated_buffers = 0;   // graph inputs whose buffer an in-place result reused
  int64_t donated_bytes = 0;
  int64_t check_status_reads = 0;  // runtime-check statuses read at host waits (one per checked program)
  int64_t host_to_device_bytes = 0;
  int64_t device_to_host_bytes = 0;
  std::map<std::string, int64_t> cpu_fallbacks;  // op name -> count
  std::map<std::string, int64_t> lowered_ops;    // op name -> executions
  std::vector<std::string> recompile_reasons;    // fused graphs: why a graph compiled again (latest 50)
};

Metrics& metrics();
void reset_metrics();

}  // namespace torch_pjrt::graph
