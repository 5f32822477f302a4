// Where user code recorded an op, for errors that surface later (a fused
// graph runs long after its ops were recorded). The Python bindings install a
// capture hook that returns a small id for the innermost user frame; the text
// ("train.py:42 in step") is made only when an error needs it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

namespace torch_pjrt::graph {

using SourceLocation = uint32_t;  // 0: unknown (no hook, or no Python frame)

struct SourceLocationHooks {
  SourceLocation (*capture)() = nullptr;
  std::string (*describe)(SourceLocation) = nullptr;
};

void set_source_location_hooks(SourceLocationHooks hooks);
SourceLocation capture_source_location();
// "train.py:42 in step", or "an unknown line" for 0.
std::string describe_source_location(SourceLocation location);
// The file and line of `location` (the program's op locations); {"", 0} when unknown.
std::pair<std::string, int> source_file_line(SourceLocation location);

}  // namespace torch_pjrt::graph
