// Serialized xla.CompileOptionsProto, written by hand: we need three fields and
// no protobuf dependency.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace torch_pjrt::pjrt {

struct CompileOptions {
  int num_replicas = 1;
  int num_partitions = 1;
  // device_ids[replica][partition]; empty lets the plugin choose.
  std::vector<std::vector<int64_t>> device_assignment;

  std::string serialize() const;
};

}  // namespace torch_pjrt::pjrt
