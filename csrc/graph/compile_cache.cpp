#include "graph/compile_cache.h"

#include <chrono>

#include "graph/metrics.h"

namespace torch_pjrt::graph {

Metrics& metrics() {
  static Metrics m;
  return m;
}

void reset_metrics() { metrics() = Metrics{}; }

pjrt::ExecutablePtr CompileCache::get_or_compile(const std::string& program, size_t device_index) {
  std::string key = std::to_string(device_index) + "\n" + program;
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    ++metrics().compile_cache_hits;
    return it->second;
  }
  auto start = std::chrono::steady_clock::now();
  pjrt::ExecutablePtr exe = client_->compile(program, {}, device_index);
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  ++metrics().compiles;
  metrics().compile_seconds += took.count();
  entries_.emplace(std::move(key), exe);
  return exe;
}

}  // namespace torch_pjrt::graph
