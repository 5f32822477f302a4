#include "pjrt/client.h"
#include "pjrt/quiet_logs.h"

#include "pjrt/error.h"

#include <cstddef>

namespace torch_pjrt::pjrt {

std::shared_ptr<Client> Client::create(std::shared_ptr<Plugin> plugin, const std::vector<CreateOption>& given) {
  std::vector<PJRT_NamedValue> options;
  for (const CreateOption& option : given) {
    auto nv = PJRT_ARGS(PJRT_NamedValue);
    nv.name = option.name.data();
    nv.name_size = option.name.size();
    nv.value_size = 1;
    if (auto* i = std::get_if<int64_t>(&option.value)) {
      nv.type = PJRT_NamedValue_kInt64;
      nv.int64_value = *i;
    } else if (auto* b = std::get_if<bool>(&option.value)) {
      nv.type = PJRT_NamedValue_kBool;
      nv.bool_value = *b;
    } else if (auto* f = std::get_if<float>(&option.value)) {
      nv.type = PJRT_NamedValue_kFloat;
      nv.float_value = *f;
    } else {
      const auto& text = std::get<std::string>(option.value);
      nv.type = PJRT_NamedValue_kString;
      nv.string_value = text.data();
      nv.value_size = text.size();
    }
    options.push_back(nv);
  }
  auto args = PJRT_ARGS(PJRT_Client_Create_Args);
  args.create_options = options.data();
  args.num_options = options.size();
  PJRT_Error* error;
  {
    QuietPluginLogs quiet;  // the CPU plugin logs its device count at INFO here
    error = plugin->api()->PJRT_Client_Create(&args);
  }
  plugin->check(error, "PJRT_Client_Create");
  return std::shared_ptr<Client>(new Client(std::move(plugin), args.client));
}

Client::Client(std::shared_ptr<Plugin> plugin, PJRT_Client* client) : plugin_(std::move(plugin)), client_(client) {
  const PJRT_Api* api = plugin_->api();
  auto devices = PJRT_ARGS(PJRT_Client_AddressableDevices_Args);
  devices.client = client_;
  plugin_->check(api->PJRT_Client_AddressableDevices(&devices), "PJRT_Client_AddressableDevices");
  devices_.assign(devices.addressable_devices, devices.addressable_devices + devices.num_addressable_devices);
  auto name = PJRT_ARGS(PJRT_Client_PlatformName_Args);
  name.client = client_;
  plugin_->check(api->PJRT_Client_PlatformName(&name), "PJRT_Client_PlatformName");
  platform_name_.assign(name.platform_name, name.platform_name_size);
  auto version = PJRT_ARGS(PJRT_Client_PlatformVersion_Args);
  version.client = client_;
  plugin_->check(api->PJRT_Client_PlatformVersion(&version), "PJRT_Client_PlatformVersion");
  platform_version_.assign(version.platform_version, version.platform_version_size);
}

Client::~Client() {
  if (in_forked_child()) return;
  auto args = PJRT_ARGS(PJRT_Client_Destroy_Args);
  args.client = client_;
  plugin_->api()->PJRT_Client_Destroy(&args);
}

PJRT_Device* Client::device(size_t index) const {
  PJRT_CHECK(index < devices_.size(), "device index ", index, " is out of range: the ", platform_name_,
             " plugin has ", devices_.size(), " device(s)");
  return devices_[index];
}

namespace {
PJRT_DeviceDescription* description(const Plugin& plugin, PJRT_Device* device) {
  auto args = PJRT_ARGS(PJRT_Device_GetDescription_Args);
  args.device = device;
  plugin.check(plugin.api()->PJRT_Device_GetDescription(&args), "PJRT_Device_GetDescription");
  return args.device_description;
}
}  // namespace

std::string Client::device_kind(size_t index) const {
  auto args = PJRT_ARGS(PJRT_DeviceDescription_Kind_Args);
  args.device_description = description(*plugin_, device(index));
  plugin_->check(plugin_->api()->PJRT_DeviceDescription_Kind(&args), "PJRT_DeviceDescription_Kind");
  return std::string(args.device_kind, args.device_kind_size);
}

int64_t Client::device_id(size_t index) const {
  auto id = PJRT_ARGS(PJRT_DeviceDescription_Id_Args);
  id.device_description = description(*plugin_, device(index));
  plugin_->check(plugin_->api()->PJRT_DeviceDescription_Id(&id), "PJRT_DeviceDescription_Id");
  return id.id;
}

CompileOptions Client::replicated_options(CompileOptions options, const std::vector<size_t>& device_indices) const {
  PJRT_CHECK(!device_indices.empty(), "a replicated program needs at least one device");
  options.num_replicas = static_cast<int>(device_indices.size());
  options.num_partitions = 1;
  options.device_assignment.clear();
  for (size_t index : device_indices) options.device_assignment.push_back({device_id(index)});
  return options;
}

ExecutablePtr Client::compile(const std::string& text, const CompileOptions& options, size_t device_index) const {
  PJRT_Device* dev = device(device_index);
  CompileOptions opts = options;
  if (opts.device_assignment.empty() && opts.num_replicas == 1 && opts.num_partitions == 1)
    opts.device_assignment = {{device_id(device_index)}};
  std::string serialized = opts.serialize();
  static const char kFormat[] = "mlir";
  auto program = PJRT_ARGS(PJRT_Program);
  program.code = const_cast<char*>(text.data());
  program.code_size = text.size();
  program.format = kFormat;
  program.format_size = sizeof(kFormat) - 1;
  auto args = PJRT_ARGS(PJRT_Client_Compile_Args);
  args.client = client_;
  args.program = &program;
  args.compile_options = serialized.data();
  args.compile_options_size = serialized.size();
  plugin_->check(plugin_->api()->PJRT_Client_Compile(&args), "compiling StableHLO");
  return std::make_shared<LoadedExecutable>(plugin_, dev, args.executable);
}

ExecutablePtr Client::deserialize(const std::string& bytes, size_t device_index) const {
  auto args = PJRT_ARGS(PJRT_Executable_DeserializeAndLoad_Args);
  args.client = client_;
  args.serialized_executable = bytes.data();
  args.serialized_executable_size = bytes.size();
  plugin_->check(plugin_->api()->PJRT_Executable_DeserializeAndLoad(&args), "PJRT_Executable_DeserializeAndLoad");
  return std::make_shared<LoadedExecutable>(plugin_, device(device_index), args.loaded_executable);
}

// Starts a host-to-device copy; `semantics` says how long the plugin may read `data`.
PJRT_Client_BufferFromHostBuffer_Args Client::start_upload(const void* data, ElementType type,
                                                           const std::vector<int64_t>& dims, size_t device_index,
                                                           PJRT_HostBufferSemantics semantics) const {
  auto args = PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  args.client = client_;
  args.data = data;
  args.type = to_pjrt(type);
  args.dims = dims.data();
  args.num_dims = dims.size();
  args.host_buffer_semantics = semantics;
  args.device = device(device_index);
  plugin_->check(plugin_->api()->PJRT_Client_BufferFromHostBuffer(&args), "PJRT_Client_BufferFromHostBuffer");
  return args;
}

BufferPtr Client::buffer_from_host(const void* data, ElementType type, const std::vector<int64_t>& dims,
                                   size_t device_index) const {
  // The plugin copies before returning, so the caller's memory is free at once.
  auto args = start_upload(data, type, dims, device_index, PJRT_HostBufferSemantics_kImmutableOnlyDuringCall);
  if (args.done_with_host_buffer) Event(plugin_, args.done_with_host_buffer).wait();
  return std::make_shared<Buffer>(plugin_, args.buffer);
}

std::pair<BufferPtr, std::unique_ptr<Event>> Client::buffer_from_host_async(const void* data, ElementType type,
                                                                            const std::vector<int64_t>& dims,
                                                                            size_t device_index) const {
  auto args =
      start_upload(data, type, dims, device_index, PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes);
  auto buffer = std::make_shared<Buffer>(plugin_, args.buffer);
  std::unique_ptr<Event> done;
  if (args.done_with_host_buffer) done = std::make_unique<Event>(plugin_, args.done_with_host_buffer);
  return {std::move(buffer), std::move(done)};
}

std::optional<MemoryStats> Client::memory_stats(size_t index) const {
  const PJRT_Api* api = plugin_->api();
  // An optional entry: older plugins' PJRT_Api ends before it, others leave it null or answer UNIMPLEMENTED.
  if (api->struct_size <= offsetof(PJRT_Api, PJRT_Device_MemoryStats) || !api->PJRT_Device_MemoryStats)
    return std::nullopt;
  auto args = PJRT_ARGS(PJRT_Device_MemoryStats_Args);
  args.device = device(index);
  try {
    plugin_->check(api->PJRT_Device_MemoryStats(&args), "PJRT_Device_MemoryStats");
  } catch (const Error&) {
    return std::nullopt;
  }
  MemoryStats stats;
  stats.bytes_in_use = args.bytes_in_use;
  if (args.peak_bytes_in_use_is_set) stats.peak_bytes_in_use = args.peak_bytes_in_use;
  if (args.bytes_limit_is_set) stats.bytes_limit = args.bytes_limit;
  return stats;
}

}  // namespace torch_pjrt::pjrt
