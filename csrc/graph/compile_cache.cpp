#include "graph/compile_cache.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <fstream>

#include "pjrt/error.h"

#include "graph/metrics.h"

namespace torch_pjrt::graph {

Metrics& metrics() {
  static Metrics m;
  return m;
}

std::mutex& metrics_mutex() {
  static std::mutex mutex;
  return mutex;
}

void count_lowered_op(const std::string& name) {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  ++metrics().lowered_ops[name];
}

void count_cpu_fallback(const std::string& name, uint32_t location) {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  ++metrics().cpu_fallbacks[name];
  auto& lines = metrics().cpu_fallback_lines[name];
  constexpr size_t kMaxLines = 10;  // distinct lines kept per op
  if (location && lines.size() < kMaxLines && std::find(lines.begin(), lines.end(), location) == lines.end())
    lines.push_back(location);
}

void note_recompile_reason(std::string reason) {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  auto& reasons = metrics().recompile_reasons;
  reasons.push_back(std::move(reason));
  if (reasons.size() > 50) reasons.erase(reasons.begin());
}

Metrics metrics_snapshot() {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  return metrics();
}

void reset_metrics() {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  metrics() = Metrics{};
}

namespace {

// TORCH_PJRT_DUMP_DIR: every program compiled is also written there as
// <hash>.mlir, to read what XLA was given. Best effort: errors are ignored.
void dump_program(const std::string& program) {
  static const char* dir = std::getenv("TORCH_PJRT_DUMP_DIR");
  if (!dir || !*dir) return;
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.mlir", static_cast<unsigned long long>(fnv1a(program)));
  std::ofstream(std::string(dir) + "/" + name) << program;
}

}  // namespace

// XLA CPU options, measured on the CPU plugin (benchmarks/bench_compile.py):
// - the MLIR fusion emitters build an MLIR context per kernel; the older
//   LLVM emitters compile a graph of many in-place row updates 4x faster and
//   run as fast;
// - optimization level 0 compiles a small program 2-3x faster but runs large
//   elementwise kernels up to 10x slower, so only Quick programs use it.
// Other plugins keep their defaults. TORCH_PJRT_XLA_TUNING=0 turns this off.
pjrt::CompileOptions CompileCache::options(Effort effort) const {
  pjrt::CompileOptions options;
  static const bool tuning = [] {
    const char* env = std::getenv("TORCH_PJRT_XLA_TUNING");
    return !env || std::string(env) != "0";
  }();
  if (!tuning || client_->platform_name() != "cpu") return options;
  options.overrides.emplace_back("xla_cpu_use_fusion_emitters", false);
  if (effort == Effort::Quick) options.overrides.emplace_back("xla_backend_optimization_level", int64_t{0});
  return options;
}

pjrt::ExecutablePtr CompileCache::get_or_compile(const std::string& program, size_t device_index, Effort effort) {
  // The serialized compile options are part of the key: the same program
  // built for other replicas or partitions, or optimized less, is another
  // executable.
  pjrt::CompileOptions compile_options = options(effort);
  std::string key = std::to_string(device_index) + "\n" + compile_options.serialize() + "\n" + program;
  return find_or_build(std::move(key), program, compile_options, device_index);
}

pjrt::ExecutablePtr CompileCache::get_or_compile_replicated(const std::string& program,
                                                            const std::vector<size_t>& device_indices) {
  pjrt::CompileOptions compile_options = client_->replicated_options(options(Effort::Full), device_indices);
  std::string key = "replicas";
  for (size_t index : device_indices) key += " " + std::to_string(index);
  key += "\n" + compile_options.serialize() + "\n" + program;
  return find_or_build(std::move(key), program, compile_options, device_indices.at(0));
}

pjrt::ExecutablePtr CompileCache::find_or_build(std::string key, const std::string& program,
                                                const pjrt::CompileOptions& compile_options, size_t device_index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      ++metrics().compile_cache_hits;
      return it->second;
    }
  }
  pjrt::ExecutablePtr exe;
  if (disk_) {
    auto start = std::chrono::steady_clock::now();
    if (auto bytes = disk_->load(key)) {
      try {
        exe = client_->deserialize(*bytes, device_index);
      } catch (const pjrt::Error&) {
        ++metrics().disk_cache_corrupt;  // verified bytes the plugin still rejects: rebuild
      }
    }
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    metrics().disk_cache_load_seconds += took.count();
  }
  if (!exe) {
    dump_program(program);
    auto start = std::chrono::steady_clock::now();
    exe = client_->compile(program, compile_options, device_index);
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    ++metrics().compiles;
    metrics().compile_seconds += took.count();
    if (disk_) {
      try {
        disk_->store(key, exe->serialize());
      } catch (const pjrt::Error&) {
        // A plugin that cannot serialize still runs; it just recompiles next time.
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.emplace(std::move(key), exe).first->second;
}

}  // namespace torch_pjrt::graph
