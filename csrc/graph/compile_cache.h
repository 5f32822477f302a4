// The compile cache every mode shares: programs keyed by their StableHLO
// text (and device), first in memory, then on disk when a directory is set
// (TORCH_PJRT_CACHE_DIR), else compiled and written to both. The ops'
// locations (the module's tail, hlo::split_locations) are not part of the
// key: the same program recorded from other lines is the same executable.
//
// Loaded executables are bounded: XLA:CPU maps memory regions for each loaded
// executable (3 per JIT object: a single op 3, a fused graph 3 per kernel or
// two, hundreds for a large graph) and a process may hold vm.max_map_count
// (65530). Past either limit (programs, or the maps they added when loaded)
// the least recently used program is unloaded; its Program keeps the text,
// and executable() loads it again (disk tier, else compile).
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "graph/disk_cache.h"
#include "pjrt/client.h"

namespace torch_pjrt::graph {

// How hard XLA optimizes a program. Quick: a small single-op program (strict
// and debug modes), where compile time dominates and a lower optimization
// level costs microseconds per run.
enum class Effort { Full, Quick };

class CompileCache;

// One program of the cache: what every plan that runs it holds. Thread safe.
class Program : public std::enable_shared_from_this<Program> {
 public:
  // The loaded executable (loaded again if it was unloaded), now the most
  // recently used. The caller keeps the pointer until every execution it
  // enqueued finished: unloading only drops the cache's reference.
  pjrt::ExecutablePtr executable();
  bool loaded() const;

 private:
  friend class CompileCache;
  Program(CompileCache& cache, std::string key, size_t text_offset, std::string locations, size_t device_index,
          Effort effort, std::vector<size_t> replicas)
      : cache_(cache), key_(std::move(key)), text_offset_(text_offset), locations_(std::move(locations)),
        device_index_(device_index), effort_(effort), replicas_(std::move(replicas)) {}
  // What XLA compiles: the keyed text with the locations it was first built with.
  std::string text() const { return std::string(std::string_view(key_).substr(text_offset_)) + locations_; }
  CompileCache& cache_;  // outlives its programs (the process's cache is never destroyed)
  const std::string key_;  // device + compile options + text without locations
  const size_t text_offset_;
  const std::string locations_;
  const size_t device_index_;
  const Effort effort_;
  const std::vector<size_t> replicas_;  // empty: one device; else one replica on each (collectives)
  // Guarded by the cache's mutex. Loaded: exe_ is set and lru_ is its place in the cache's list.
  pjrt::ExecutablePtr exe_;
  int64_t maps_ = 0;  // memory maps loading it added (measured: XLA decides how many JIT objects it has)
  std::list<std::shared_ptr<Program>>::iterator lru_;
};
using ProgramPtr = std::shared_ptr<Program>;

// When the cache unloads programs (least recently used first).
struct LoadLimits {
  // TORCH_PJRT_MAX_LOADED_PROGRAMS: loaded programs at most.
  int64_t programs = 4096;
  // TORCH_PJRT_MAX_LOADED_MAPS: memory maps the loaded programs added, at
  // most. Default: half of vm.max_map_count, the other half for the process.
  int64_t maps = 32765;
};

class CompileCache {
 public:
  using Limits = LoadLimits;
  static Limits limits_from_env();

  explicit CompileCache(std::shared_ptr<pjrt::Client> client, std::unique_ptr<DiskCache> disk = nullptr,
                        Limits limits = {});
  // The program, compiled (and loaded) now if new, so compile errors raise here.
  ProgramPtr get_or_compile(const std::string& program, size_t device_index, Effort effort = Effort::Full);
  // One program run as a replica on each of `device_indices` (collectives
  // across devices); the key holds the device set and its order.
  ProgramPtr get_or_compile_replicated(const std::string& program, const std::vector<size_t>& device_indices);
  // The options a program of `effort` is compiled with (part of the cache key).
  pjrt::CompileOptions options(Effort effort) const;
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }
  size_t loaded() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lru_.size();
  }
  int64_t loaded_maps() const {  // memory maps the loaded programs added
    std::lock_guard<std::mutex> lock(mutex_);
    return loaded_maps_;
  }
  const Limits& limits() const { return limits_; }
  void clear();

 private:
  friend class Program;
  ProgramPtr find_or_add(std::string prefix, std::string_view program, size_t device_index, Effort effort,
                         std::vector<size_t> replicas);
  pjrt::CompileOptions options_of(const Program& p) const;
  struct Loaded {
    pjrt::ExecutablePtr exe;
    int64_t maps = 0;  // memory maps the process gained while loading it
  };
  Loaded load(const Program& p, bool reload);  // disk tier, else compile; no lock held
  pjrt::ExecutablePtr executable(Program& p);
  // Makes `loaded` p's executable (unless another thread loaded it first) and
  // unloads the least recently used programs past the limits into `unloaded`.
  pjrt::ExecutablePtr install(Program& p, Loaded loaded, std::vector<pjrt::ExecutablePtr>& unloaded);

  std::shared_ptr<pjrt::Client> client_;
  std::unique_ptr<DiskCache> disk_;
  const Limits limits_;
  mutable std::mutex mutex_;  // guards entries_ and every Program's loaded state; compiles run outside it
  std::unordered_map<std::string_view, ProgramPtr> entries_;  // key: its Program's key_
  std::list<ProgramPtr> lru_;  // loaded programs, most recently used first
  int64_t loaded_maps_ = 0;    // sum of their maps_
};

}  // namespace torch_pjrt::graph
