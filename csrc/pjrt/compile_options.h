// Serialized xla.CompileOptionsProto, written by hand: we need a few fields and
// no protobuf dependency.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace torch_pjrt::pjrt {

struct CompileOptions {
  int num_replicas = 1;
  int num_partitions = 1;
  // device_ids[replica][partition]; empty lets the plugin choose.
  std::vector<std::vector<int64_t>> device_assignment;
  // XLA DebugOptions fields by name (CompileOptionsProto.env_option_overrides),
  // applied on top of the plugin's defaults. A name the plugin does not know
  // fails the compile, so only set fields the plugin is known to have.
  std::vector<std::pair<std::string, std::variant<bool, int64_t>>> overrides;

  std::string serialize() const;
};

}  // namespace torch_pjrt::pjrt
