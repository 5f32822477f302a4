#include "pjrt/executable.h"

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
  for (PJRT_Buffer* b : raw_outputs) result.outputs.push_back(std::make_shared<Buffer>(plugin_, b));
  if (done) result.done = std::make_unique<Event>(plugin_, done);
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
