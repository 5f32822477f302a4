#include "graph/settings.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

namespace torch_pjrt::graph::settings {

const std::vector<Setting>& all() {
  static const std::vector<Setting> table = {
      // Which device, how it runs.
      {"TORCH_PJRT_PLUGIN", "cpu", "PJRT plugin: cpu, cuda, tpu, or the path of a plugin .so"},
      {"TORCH_PJRT_MODE", "fused", "execution mode: fused, strict, lazy or debug (torch_pjrt.set_mode)"},
      {"TORCH_PJRT_CPU_DEVICES", "1", "devices the CPU plugin creates (tpu:0..N-1); under torchrun, devices per process"},
      {"TORCH_PJRT_GPU_PREALLOCATE", "0", "CUDA plugin: reserve GPU memory at start (1) instead of growing on demand"},
      {"TORCH_PJRT_GPU_MEMORY_FRACTION", "", "CUDA plugin: the fraction of GPU memory the plugin may use"},
      {"TORCH_PJRT_GPU_IEEE_DIV", "1", "CUDA plugin: correctly rounded float32 division, as PyTorch's CUDA kernels (0: XLA's default)"},
      // Compiling and the compile cache.
      {"TORCH_PJRT_CACHE_DIR", "$XDG_CACHE_HOME/torch_pjrt or ~/.cache/torch_pjrt",
       "persistent compile cache shared by processes; set to empty, 0 or off for memory only"},
      {"TORCH_PJRT_CACHE_MAX_BYTES", "4294967296", "size of the persistent compile cache before old programs are removed"},
      {"TORCH_PJRT_MAX_LOADED_PROGRAMS", "4096", "loaded executables at most (least recently used unloaded first)"},
      {"TORCH_PJRT_MAX_LOADED_MAPS", "half of vm.max_map_count", "memory maps loaded executables may add, at most"},
      {"TORCH_PJRT_XLA_TUNING", "1", "XLA:CPU options measured for this project (0: XLA's defaults)"},
      {"TORCH_PJRT_DUMP_DIR", "", "write every compiled program there as <hash>.mlir"},
      // Fused graphs and compiled mode.
      {"TORCH_PJRT_FUSION_LIMIT", "2000", "ops in a fused graph before it is cut"},
      {"TORCH_PJRT_FUSION_COST", "8192", "estimated cost of a fused graph before it is cut"},
      {"TORCH_PJRT_BATCH_BUCKETS", "1", "torch.compile inference: run a dynamic batch at a bucket size (0: every exact size)"},
      {"TORCH_PJRT_COMPILE_REPLAY", "1", "torch.compile: replay a compiled graph as one program (0: op by op, fused)"},
      // Serving.
      {"TORCH_PJRT_VLLM", "", "vLLM platform plugin: 1 always takes the tpu platform, 0 steps aside (unset: see docs/serving.md)"},
      // Debugging.
      {"TORCH_PJRT_CHECK_NANS", "0", "debug mode: raise at the op whose floating-point result has a NaN or Inf"},
  };
  return table;
}

namespace {

const Setting& find(const std::string& name) {
  for (const Setting& s : all())
    if (name == s.name) return s;
  throw std::logic_error("torch_pjrt reads the environment variable " + name +
                         ", which is missing from the settings table (csrc/graph/settings.cpp)");
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// The user's value, else the default; empty when both are empty.
std::string value_or_default(const std::string& name) {
  const Setting& s = find(name);
  const char* value = std::getenv(s.name);
  return value && *value ? std::string(value) : std::string(s.default_value);
}

[[noreturn]] void bad_value(const std::string& name, const std::string& value, const std::string& expected) {
  throw std::invalid_argument(name + " must be " + expected + ", got '" + value + "'");
}

}  // namespace

std::optional<std::string> raw(const std::string& name) {
  const char* value = std::getenv(find(name).name);
  if (!value) return std::nullopt;
  return std::string(value);
}

std::string text(const std::string& name) { return value_or_default(name); }

bool flag(const std::string& name) {
  std::string value = lower(value_or_default(name));
  if (value == "1" || value == "true" || value == "on" || value == "yes") return true;
  if (value == "0" || value == "false" || value == "off" || value == "no" || value.empty()) return false;
  bad_value(name, value, "1 or 0 (true/false, on/off)");
}

int64_t integer(const std::string& name, int64_t minimum) {
  std::string value = value_or_default(name);
  char* end = nullptr;
  long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end || n < minimum)
    bad_value(name, value, minimum == 1 ? "a positive integer" : minimum == 0 ? "an integer >= 0" : "an integer");
  return n;
}

std::optional<double> number(const std::string& name) {
  std::string value = value_or_default(name);
  if (value.empty()) return std::nullopt;
  char* end = nullptr;
  double x = std::strtod(value.c_str(), &end);
  if (*end) bad_value(name, value, "a number");
  return x;
}

}  // namespace torch_pjrt::graph::settings
