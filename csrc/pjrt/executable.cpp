#include "pjrt/executable.h"

#include <algorithm>
#include <atomic>

#include "pjrt/error.h"

namespace torch_pjrt::pjrt {

namespace {
std::atomic<int64_t> g_alive{0};
}  // namespace

int64_t LoadedExecutable::alive() { return g_alive.load(std::memory_order_relaxed); }

LoadedExecutable::LoadedExecutable(std::shared_ptr<Plugin> plugin, PJRT_Device* device, PJRT_LoadedExecutable* exe)
    : plugin_(std::move(plugin)), device_(device), exe_(exe) {
  const PJRT_Api* api = plugin_->api();
  auto get = PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = exe_;
  plugin_->check(api->PJRT_LoadedExecutable_GetExecutable(&get), "PJRT_LoadedExecutable_GetExecutable");
  auto outputs = PJRT_ARGS(PJRT_Executable_NumOutputs_Args);
  outputs.executable = get.executable;
  plugin_->check(api->PJRT_Executable_NumOutputs(&outputs), "PJRT_Executable_NumOutputs");
  num_outputs_ = outputs.num_outputs;
  auto destroy = PJRT_ARGS(PJRT_Executable_Destroy_Args);
  destroy.executable = get.executable;
  plugin_->check(api->PJRT_Executable_Destroy(&destroy), "PJRT_Executable_Destroy");
  ++g_alive;
}

LoadedExecutable::~LoadedExecutable() {
  --g_alive;
  if (in_forked_child()) return;
  auto args = PJRT_ARGS(PJRT_LoadedExecutable_Destroy_Args);
  args.executable = exe_;
  plugin_->api()->PJRT_LoadedExecutable_Destroy(&args);
}

LoadedExecutable::Result LoadedExecutable::execute(const std::vector<Buffer*>& args,
                                                   const std::vector<int64_t>& non_donatable) const {
  std::vector<PJRT_Buffer*> raw_args;
  raw_args.reserve(args.size());
  for (Buffer* b : args) raw_args.push_back(b->raw());
  PJRT_Buffer* const* arg_list = raw_args.data();
  std::vector<PJRT_Buffer*> raw_outputs(num_outputs_, nullptr);
  PJRT_Buffer** output_list = raw_outputs.data();
  PJRT_Event* done = nullptr;

  auto options = PJRT_ARGS(PJRT_ExecuteOptions);
  options.non_donatable_input_indices = non_donatable.data();
  options.num_non_donatable_input_indices = non_donatable.size();
  auto exec = PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  exec.executable = exe_;
  exec.options = &options;
  exec.argument_lists = &arg_list;
  exec.num_devices = 1;
  exec.num_args = raw_args.size();
  exec.output_lists = &output_list;
  exec.device_complete_events = &done;
  plugin_->check(plugin_->api()->PJRT_LoadedExecutable_Execute(&exec), "PJRT_LoadedExecutable_Execute");

  Result result;
  result.outputs.reserve(num_outputs_);
  std::lock_guard<std::mutex> lock(output_types_mutex_);
  if (output_types_.empty()) {
    for (PJRT_Buffer* b : raw_outputs) {
      result.outputs.push_back(std::make_shared<Buffer>(plugin_, b));
      output_types_.emplace_back(result.outputs.back()->element_type(), result.outputs.back()->dims());
    }
  } else {
    for (size_t k = 0; k < raw_outputs.size(); ++k)
      result.outputs.push_back(
          std::make_shared<Buffer>(plugin_, raw_outputs[k], output_types_[k].first, output_types_[k].second));
  }
  if (done) result.done = std::make_unique<Event>(plugin_, done);
  return result;
}

std::vector<PJRT_Device*> LoadedExecutable::addressable_devices() const {
  auto args = PJRT_ARGS(PJRT_LoadedExecutable_AddressableDevices_Args);
  args.executable = exe_;
  plugin_->check(plugin_->api()->PJRT_LoadedExecutable_AddressableDevices(&args),
                 "PJRT_LoadedExecutable_AddressableDevices");
  return {args.addressable_devices, args.addressable_devices + args.num_addressable_devices};
}

LoadedExecutable::ReplicatedResult LoadedExecutable::execute_replicated(
    const std::vector<std::vector<Buffer*>>& args, const std::vector<PJRT_Device*>& replica_devices) const {
  // The plugin wants argument lists in its own device order; map replicas onto it.
  std::vector<PJRT_Device*> order = addressable_devices();
  PJRT_CHECK(args.size() == replica_devices.size() && order.size() == args.size(), "internal: ", args.size(),
             " argument lists for a program on ", order.size(), " device(s)");
  std::vector<size_t> replica_at(order.size());  // plugin position -> replica
  for (size_t pos = 0; pos < order.size(); ++pos) {
    auto it = std::find(replica_devices.begin(), replica_devices.end(), order[pos]);
    PJRT_CHECK(it != replica_devices.end(), "internal: the program runs on a device no replica names");
    replica_at[pos] = static_cast<size_t>(it - replica_devices.begin());
  }
  const size_t n = order.size();
  std::vector<std::vector<PJRT_Buffer*>> raw_args(n);
  std::vector<PJRT_Buffer* const*> arg_lists(n);
  std::vector<std::vector<PJRT_Buffer*>> raw_outputs(n, std::vector<PJRT_Buffer*>(num_outputs_, nullptr));
  std::vector<PJRT_Buffer**> output_lists(n);
  std::vector<PJRT_Event*> done(n, nullptr);
  for (size_t pos = 0; pos < n; ++pos) {
    const auto& replica_args = args[replica_at[pos]];
    PJRT_CHECK(replica_args.size() == args[0].size(), "internal: replicas take different argument counts");
    for (Buffer* b : replica_args) raw_args[pos].push_back(b->raw());
    arg_lists[pos] = raw_args[pos].data();
    output_lists[pos] = raw_outputs[pos].data();
  }
  auto options = PJRT_ARGS(PJRT_ExecuteOptions);
  auto exec = PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  exec.executable = exe_;
  exec.options = &options;
  exec.argument_lists = arg_lists.data();
  exec.num_devices = n;
  exec.num_args = args[0].size();
  exec.output_lists = output_lists.data();
  exec.device_complete_events = done.data();
  plugin_->check(plugin_->api()->PJRT_LoadedExecutable_Execute(&exec), "PJRT_LoadedExecutable_Execute");

  ReplicatedResult result;
  result.outputs.resize(n);
  result.done.resize(n);
  for (size_t pos = 0; pos < n; ++pos) {
    size_t r = replica_at[pos];
    for (PJRT_Buffer* b : raw_outputs[pos]) result.outputs[r].push_back(std::make_shared<Buffer>(plugin_, b));
    if (done[pos]) result.done[r] = std::make_unique<Event>(plugin_, done[pos]);
  }
  return result;
}

std::string LoadedExecutable::serialize() const {
  const PJRT_Api* api = plugin_->api();
  auto get = PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  get.loaded_executable = exe_;
  plugin_->check(api->PJRT_LoadedExecutable_GetExecutable(&get), "PJRT_LoadedExecutable_GetExecutable");
  auto ser = PJRT_ARGS(PJRT_Executable_Serialize_Args);
  ser.executable = get.executable;
  PJRT_Error* error = api->PJRT_Executable_Serialize(&ser);
  std::string bytes;
  if (!error) bytes.assign(ser.serialized_bytes, ser.serialized_bytes_size);
  if (ser.serialized_executable_deleter) ser.serialized_executable_deleter(ser.serialized_executable);
  auto destroy = PJRT_ARGS(PJRT_Executable_Destroy_Args);
  destroy.executable = get.executable;
  api->PJRT_Executable_Destroy(&destroy);
  plugin_->check(error, "PJRT_Executable_Serialize");
  return bytes;
}

}  // namespace torch_pjrt::pjrt
