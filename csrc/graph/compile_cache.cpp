#include "graph/compile_cache.h"
#include "graph/settings.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <fstream>

#include <fcntl.h>
#include <unistd.h>

#include "pjrt/error.h"

#include "graph/metrics.h"
#include "hlo/builder.h"

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
// <hash>.mlir (the hash of the text without its locations), to read what XLA
// was given, each op's location included. Best effort: errors are ignored.
void dump_program(const std::string& program) {
  static const std::string dir = settings::text("TORCH_PJRT_DUMP_DIR");
  if (dir.empty()) return;
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.mlir", static_cast<unsigned long long>(fnv1a(std::string(hlo::split_locations(program).first))));
  std::ofstream(dir + "/" + name) << program;
}

}  // namespace

// XLA CPU options, measured on the CPU plugin (benchmarks/bench_compile.py,
// benchmarks/bench_compile_backend.py): optimization level 0 compiles a small
// program 2-3x faster but runs large elementwise kernels up to 10x slower, so
// only Quick programs use it. XLA's MLIR fusion emitters stay on: turning
// them off (once 4x faster to compile for many in-place row updates, before
// those became dynamic_update_slice) now costs 1.4x run time on a GPT step and
// compiles slower too. Other plugins keep their defaults.
// TORCH_PJRT_XLA_TUNING=0 turns this off.
//
// Every plugin: no excess precision. PyTorch rounds each op's result to its
// dtype; XLA by default may keep an f16/bf16 intermediate in f32 when a convert
// follows (on the GPU, f16 `mul` then out=f32 skipped the f16 rounding).
pjrt::CompileOptions CompileCache::options(Effort effort) const {
  pjrt::CompileOptions options;
  options.overrides.emplace_back("xla_allow_excess_precision", false);
  static const bool tuning = settings::flag("TORCH_PJRT_XLA_TUNING");
  if (!tuning || client_->platform_name() != "cpu") return options;
  if (effort == Effort::Quick) options.overrides.emplace_back("xla_backend_optimization_level", int64_t{0});
  return options;
}

namespace {

// Lines of /proc/self/maps (-1 where there is none): what vm.max_map_count limits.
int64_t process_memory_maps() {
  int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buffer[1 << 16];
  int64_t lines = 0;
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) lines += std::count(buffer, buffer + n, '\n');
  ::close(fd);
  return lines;
}

}  // namespace

CompileCache::Limits CompileCache::limits_from_env() {
  Limits limits;
  limits.programs = settings::integer("TORCH_PJRT_MAX_LOADED_PROGRAMS", 1);
  // A POSIX read: the first stream use at start-up is where a _C.so built by a
  // g++ carrying its own libstdc++ locale code crashed (docs/design/gpu.md).
  if (int fd = ::open("/proc/sys/vm/max_map_count", O_RDONLY); fd >= 0) {
    char text[32] = {};
    ssize_t n = ::read(fd, text, sizeof(text) - 1);
    ::close(fd);
    int64_t max_map_count = n > 0 ? std::strtoll(text, nullptr, 10) : 0;
    if (max_map_count > 1) limits.maps = max_map_count / 2;
  }
  if (settings::raw("TORCH_PJRT_MAX_LOADED_MAPS").value_or("") != "")
    limits.maps = settings::integer("TORCH_PJRT_MAX_LOADED_MAPS", 1);
  return limits;
}

CompileCache::CompileCache(std::shared_ptr<pjrt::Client> client, std::unique_ptr<DiskCache> disk, Limits limits)
    : client_(std::move(client)), disk_(std::move(disk)), limits_(limits) {}

pjrt::ExecutablePtr Program::executable() { return cache_.executable(*this); }

bool Program::loaded() const {
  std::lock_guard<std::mutex> lock(cache_.mutex_);
  return exe_ != nullptr;
}

ProgramPtr CompileCache::get_or_compile(const std::string& program, size_t device_index, Effort effort) {
  // The serialized compile options are part of the key: the same program
  // built for other replicas or partitions, or optimized less, is another
  // executable.
  std::string prefix = std::to_string(device_index) + "\n" + options(effort).serialize() + "\n";
  return find_or_add(std::move(prefix), program, device_index, effort, {});
}

ProgramPtr CompileCache::get_or_compile_replicated(const std::string& program,
                                                   const std::vector<size_t>& device_indices) {
  std::string prefix = "replicas";
  for (size_t index : device_indices) prefix += " " + std::to_string(index);
  prefix += "\n" + client_->replicated_options(options(Effort::Full), device_indices).serialize() + "\n";
  return find_or_add(std::move(prefix), program, device_indices.at(0), Effort::Full, device_indices);
}

pjrt::CompileOptions CompileCache::options_of(const Program& p) const {
  pjrt::CompileOptions base = options(p.effort_);
  return p.replicas_.empty() ? base : client_->replicated_options(base, p.replicas_);
}

ProgramPtr CompileCache::find_or_add(std::string prefix, std::string_view program, size_t device_index,
                                     Effort effort, std::vector<size_t> replicas) {
  auto [body, locations] = hlo::split_locations(program);
  const size_t text_offset = prefix.size();
  std::string key = std::move(prefix);
  key += body;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      ++metrics().compile_cache_hits;
      return it->second;
    }
  }
  ProgramPtr p(new Program(*this, std::move(key), text_offset, std::string(locations), device_index, effort,
                           std::move(replicas)));
  Loaded loaded = load(*p, /*reload=*/false);
  std::vector<pjrt::ExecutablePtr> unloaded;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  auto [it, fresh] = entries_.emplace(std::string_view(p->key_), p);
  if (fresh) install(*p, std::move(loaded), unloaded);  // else another thread compiled it too: use theirs
  return it->second;
}

pjrt::ExecutablePtr CompileCache::executable(Program& p) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (p.exe_) {
      lru_.splice(lru_.begin(), lru_, p.lru_);
      return p.exe_;
    }
  }
  Loaded loaded = load(p, /*reload=*/true);
  std::vector<pjrt::ExecutablePtr> unloaded;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  return install(p, std::move(loaded), unloaded);
}

pjrt::ExecutablePtr CompileCache::install(Program& p, Loaded loaded, std::vector<pjrt::ExecutablePtr>& unloaded) {
  if (p.exe_) {  // another thread reloaded it meanwhile
    lru_.splice(lru_.begin(), lru_, p.lru_);
    return p.exe_;
  }
  // The list owns the program: one a plan holds stays unloadable after clear().
  p.exe_ = std::move(loaded.exe);
  p.maps_ = loaded.maps;
  loaded_maps_ += p.maps_;
  lru_.push_front(p.shared_from_this());
  p.lru_ = lru_.begin();
  auto over = [&] {
    return lru_.size() > static_cast<size_t>(limits_.programs) || loaded_maps_ > limits_.maps;
  };
  while (lru_.size() > 1 && over()) {  // the newest stays, whatever its size
    Program& old = *lru_.back();
    unloaded.push_back(std::move(old.exe_));
    loaded_maps_ -= old.maps_;
    lru_.pop_back();
    ++metrics().programs_unloaded;
  }
  return p.exe_;
}

CompileCache::Loaded CompileCache::load(const Program& p, bool reload) {
  pjrt::ExecutablePtr exe;
  int64_t maps_before = process_memory_maps();
  if (disk_) {
    auto start = std::chrono::steady_clock::now();
    if (auto bytes = disk_->load(p.key_)) {
      try {
        exe = client_->deserialize(*bytes, p.device_index_);
      } catch (const pjrt::Error&) {
        ++metrics().disk_cache_corrupt;  // verified bytes the plugin still rejects: rebuild
      }
    }
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    metrics().disk_cache_load_seconds += took.count();
  }
  if (!exe) {
    std::string text = p.text();
    if (!reload) dump_program(text);
    auto start = std::chrono::steady_clock::now();
    exe = client_->compile(text, options_of(p), p.device_index_);
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    ++metrics().compiles;
    metrics().compile_seconds += took.count();
    if (disk_) {
      try {
        disk_->store(p.key_, exe->serialize());
      } catch (const pjrt::Error&) {
        // A plugin that cannot serialize still runs; it just recompiles next time.
      }
    }
  }
  if (reload) ++metrics().programs_reloaded;
  // Other threads loading or unloading meanwhile blur the count; the bound stays approximate, never unbounded.
  int64_t maps_after = process_memory_maps();
  return {std::move(exe), maps_before < 0 ? 0 : std::max<int64_t>(0, maps_after - maps_before)};
}

void CompileCache::clear() {
  std::vector<pjrt::ExecutablePtr> unloaded;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  for (ProgramPtr& p : lru_) unloaded.push_back(std::move(p->exe_));
  lru_.clear();
  entries_.clear();
}

}  // namespace torch_pjrt::graph
