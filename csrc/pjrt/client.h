// A PJRT client: devices, compilation and host-to-device transfers.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "pjrt/buffer.h"
#include "pjrt/event.h"
#include "pjrt/compile_options.h"
#include "pjrt/executable.h"

namespace torch_pjrt::pjrt {

// One PJRT_Client_Create option. Plugins reject names they do not know, so
// which options a client gets depends on the plugin (see aten/device.cpp).
// What a plugin says of a device's memory (PJRT_Device_MemoryStats); -1: not said.
struct MemoryStats {
  int64_t bytes_in_use = 0;
  int64_t peak_bytes_in_use = -1;
  int64_t bytes_limit = -1;
};

struct CreateOption {
  std::string name;
  std::variant<int64_t, bool, float, std::string> value;
};

class Client {
 public:
  static std::shared_ptr<Client> create(std::shared_ptr<Plugin> plugin, const std::vector<CreateOption>& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::shared_ptr<Plugin>& plugin() const { return plugin_; }
  const std::string& platform_name() const { return platform_name_; }
  const std::string& platform_version() const { return platform_version_; }
  size_t device_count() const { return devices_.size(); }
  PJRT_Device* device(size_t index) const;
  std::string device_kind(size_t index) const;
  // The plugin's global id of device `index` (what a device assignment lists).
  int64_t device_id(size_t index) const;
  // Empty when the plugin does not report memory statistics (the CPU plugin).
  std::optional<MemoryStats> memory_stats(size_t index) const;

  // A program with options.num_replicas > 1 runs on the devices its
  // options.device_assignment names (see compile_replicated); `device_index` is
  // then only the executable's nominal device.
  ExecutablePtr compile(const std::string& stablehlo_text, const CompileOptions& options, size_t device_index = 0) const;
  // `options` for one program run as one replica on each of `device_indices`
  // (replica i on device_indices[i]): num_replicas and the device assignment.
  CompileOptions replicated_options(CompileOptions options, const std::vector<size_t>& device_indices) const;
  ExecutablePtr deserialize(const std::string& bytes, size_t device_index = 0) const;

  // Copies `data` (row-major, dense) to a new buffer on `device_index`.
  BufferPtr buffer_from_host(const void* data, ElementType type, const std::vector<int64_t>& dims,
                             size_t device_index = 0) const;
  // The same without waiting: the plugin may read `data` until the returned
  // event fires (null when it is done already), so the caller keeps that
  // memory alive and unchanged until then (a non_blocking copy from pinned memory).
  std::pair<BufferPtr, std::unique_ptr<Event>> buffer_from_host_async(const void* data, ElementType type,
                                                                      const std::vector<int64_t>& dims,
                                                                      size_t device_index = 0) const;

 private:
  Client(std::shared_ptr<Plugin> plugin, PJRT_Client* client);
  PJRT_Client_BufferFromHostBuffer_Args start_upload(const void* data, ElementType type,
                                                     const std::vector<int64_t>& dims, size_t device_index,
                                                     PJRT_HostBufferSemantics semantics) const;
  std::shared_ptr<Plugin> plugin_;
  PJRT_Client* client_;
  std::vector<PJRT_Device*> devices_;
  std::string platform_name_;
  std::string platform_version_;
};

}  // namespace torch_pjrt::pjrt
