#include "pjrt/compile_options.h"

namespace torch_pjrt::pjrt {
namespace {

// Protobuf wire format: varint (type 0) and length-delimited (type 2) fields.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_int_field(std::string& out, int field, int64_t v) {
  put_varint(out, static_cast<uint64_t>(field) << 3);
  put_varint(out, static_cast<uint64_t>(v));
}
void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

}  // namespace

std::string CompileOptions::serialize() const {
  // ExecutableBuildOptionsProto: num_replicas = 4, num_partitions = 5,
  // device_assignment = 9 (DeviceAssignmentProto: replica_count = 1,
  // computation_count = 2, computation_devices = 3 { replica_device_ids = 1 }).
  std::string build;
  put_int_field(build, 4, num_replicas);
  put_int_field(build, 5, num_partitions);
  if (!device_assignment.empty()) {
    std::string assignment;
    put_int_field(assignment, 1, num_replicas);
    put_int_field(assignment, 2, num_partitions);
    for (int p = 0; p < num_partitions; ++p) {
      std::string computation;
      for (int r = 0; r < num_replicas; ++r) put_int_field(computation, 1, device_assignment[r][p]);
      put_bytes_field(assignment, 3, computation);
    }
    put_bytes_field(build, 9, assignment);
  }
  std::string options;  // CompileOptionsProto.executable_build_options = 3
  put_bytes_field(options, 3, build);
  // env_option_overrides = 7: map<string, OptionOverrideProto>, each entry a
  // message {key = 1, value = 2}; OptionOverrideProto: bool_field = 2, int_field = 3.
  for (const auto& [name, value] : overrides) {
    std::string override_value;
    if (std::holds_alternative<bool>(value)) put_int_field(override_value, 2, std::get<bool>(value));
    else put_int_field(override_value, 3, std::get<int64_t>(value));
    std::string entry;
    put_bytes_field(entry, 1, name);
    put_bytes_field(entry, 2, override_value);
    put_bytes_field(options, 7, entry);
  }
  return options;
}

}  // namespace torch_pjrt::pjrt
