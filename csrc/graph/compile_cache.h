// The compile cache every mode shares: programs keyed by their StableHLO
// text (and device), first in memory, then on disk when a directory is set
// (TORCH_PJRT_CACHE_DIR), else compiled and written to both.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph/disk_cache.h"
#include "pjrt/client.h"

namespace torch_pjrt::graph {

// How hard XLA optimizes a program. Quick: a small single-op program (strict
// and debug modes), where compile time dominates and a lower optimization
// level costs microseconds per run.
enum class Effort { Full, Quick };

class CompileCache {
 public:
  explicit CompileCache(std::shared_ptr<pjrt::Client> client, std::unique_ptr<DiskCache> disk = nullptr)
      : client_(std::move(client)), disk_(std::move(disk)) {}
  pjrt::ExecutablePtr get_or_compile(const std::string& program, size_t device_index, Effort effort = Effort::Full);
  // One program run as a replica on each of `device_indices` (collectives
  // across devices); the key holds the device set and its order.
  pjrt::ExecutablePtr get_or_compile_replicated(const std::string& program, const std::vector<size_t>& device_indices);
  // The options a program of `effort` is compiled with (part of the cache key).
  pjrt::CompileOptions options(Effort effort) const;
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
  }

 private:
  pjrt::ExecutablePtr find_or_build(std::string key, const std::string& program,
                                    const pjrt::CompileOptions& compile_options, size_t device_index);
  std::shared_ptr<pjrt::Client> client_;
  std::unique_ptr<DiskCache> disk_;
  mutable std::mutex mutex_;  // guards entries_; compiles run outside it (a race compiles twice, harmlessly)
  std::unordered_map<std::string, pjrt::ExecutablePtr> entries_;  // key: device + program
};

}  // namespace torch_pjrt::graph
