#include "graph/compile_cache.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
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

void count_cpu_fallback(const std::string& name) {
  std::lock_guard<std::mutex> lock(metrics_mutex());
  ++metrics().cpu_fallbacks[name];
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

pjrt::ExecutablePtr CompileCache::get_or_compile(const std::string& program, size_t device_index) {
  // The serialized compile options are part of the key: the same program
  // built for other replicas or partitions is another executable.
  static const std::string options = pjrt::CompileOptions{}.serialize();
  std::string key = std::to_string(device_index) + "\n" + options + "\n" + program;
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
    exe = client_->compile(program, {}, device_index);
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
