#include "pjrt/plugin.h"

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <vector>

#include "pjrt/error.h"

namespace torch_pjrt::pjrt {
namespace {
std::atomic<bool> g_forked_child{false};
}  // namespace

void mark_forked_child() { g_forked_child = true; }
bool in_forked_child() { return g_forked_child; }

namespace {

struct ApiFunction {
  const char* name;
  size_t offset;  // in PJRT_Api
};
#define TORCH_PJRT_API_FUNCTION(name) ApiFunction{#name, offsetof(PJRT_Api, name)}

// Every PJRT_Api function torch_pjrt calls (grep for `->PJRT_`). All of them
// sit before the header's "always add new fields to the end" mark, so any
// 0.x plugin has them; the check guards whatever a later change calls.
const std::vector<ApiFunction>& functions_we_call() {
  static const std::vector<ApiFunction> fns{
      TORCH_PJRT_API_FUNCTION(PJRT_Error_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_Error_Message),
      TORCH_PJRT_API_FUNCTION(PJRT_Error_GetCode),
      TORCH_PJRT_API_FUNCTION(PJRT_Plugin_Initialize),
      TORCH_PJRT_API_FUNCTION(PJRT_Event_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_Event_IsReady),
      TORCH_PJRT_API_FUNCTION(PJRT_Event_OnReady),
      TORCH_PJRT_API_FUNCTION(PJRT_Event_Error),
      TORCH_PJRT_API_FUNCTION(PJRT_Event_Await),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_Create),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_PlatformName),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_PlatformVersion),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_AddressableDevices),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_Compile),
      TORCH_PJRT_API_FUNCTION(PJRT_Client_BufferFromHostBuffer),
      TORCH_PJRT_API_FUNCTION(PJRT_DeviceDescription_Id),
      TORCH_PJRT_API_FUNCTION(PJRT_DeviceDescription_Kind),
      TORCH_PJRT_API_FUNCTION(PJRT_Device_GetDescription),
      TORCH_PJRT_API_FUNCTION(PJRT_Executable_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_Executable_NumOutputs),
      TORCH_PJRT_API_FUNCTION(PJRT_Executable_Serialize),
      TORCH_PJRT_API_FUNCTION(PJRT_Executable_DeserializeAndLoad),
      TORCH_PJRT_API_FUNCTION(PJRT_LoadedExecutable_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_LoadedExecutable_GetExecutable),
      TORCH_PJRT_API_FUNCTION(PJRT_LoadedExecutable_Execute),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_Destroy),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_ElementType),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_Dimensions),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_IsDeleted),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_ToHostBuffer),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_CopyToDevice),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_ReadyEvent),
      TORCH_PJRT_API_FUNCTION(PJRT_Buffer_UnsafePointer),
  };
  return fns;
}
#undef TORCH_PJRT_API_FUNCTION

std::string version_text(int major, int minor) { return std::to_string(major) + "." + std::to_string(minor); }

}  // namespace

std::string api_incompatibility(const PJRT_Api& api) {
  const std::string ours = version_text(PJRT_API_MAJOR, PJRT_API_MINOR);
  if (api.struct_size < PJRT_STRUCT_SIZE(PJRT_Api, pjrt_api_version))
    return "its PJRT_Api table is " + std::to_string(api.struct_size) + " bytes, too small to hold a version";
  const auto& v = api.pjrt_api_version;
  const std::string theirs = version_text(v.major_version, v.minor_version);
  if (v.major_version != PJRT_API_MAJOR)
    return "it has PJRT API version " + theirs + " but torch_pjrt was built against " + ours +
           " (major versions are incompatible)";
  std::string missing;
  for (const ApiFunction& fn : functions_we_call()) {
    bool present = fn.offset + sizeof(void*) <= api.struct_size &&
                   *reinterpret_cast<void* const*>(reinterpret_cast<const char*>(&api) + fn.offset) != nullptr;
    if (!present) missing += (missing.empty() ? "" : ", ") + std::string(fn.name);
  }
  if (!missing.empty())
    return "it has PJRT API version " + theirs + " (torch_pjrt was built against " + ours +
           ") and lacks functions torch_pjrt calls: " + missing;
  return "";
}

std::shared_ptr<Plugin> Plugin::load(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  PJRT_CHECK(handle, "could not load PJRT plugin '", path, "': ", dlerror());
  using GetApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetApiFn>(dlsym(handle, "GetPjrtApi"));
  PJRT_CHECK(get_api, "'", path, "' is not a PJRT plugin: it exports no GetPjrtApi");
  const PJRT_Api* api = get_api();
  PJRT_CHECK(api, "GetPjrtApi in '", path, "' returned null");
  std::string why = api_incompatibility(*api);
  PJRT_CHECK(why.empty(), "PJRT plugin '", path, "' cannot be used: ", why);
  std::shared_ptr<Plugin> plugin(new Plugin(path, handle, api));
  auto init = PJRT_ARGS(PJRT_Plugin_Initialize_Args);
  plugin->check(api->PJRT_Plugin_Initialize(&init), "PJRT_Plugin_Initialize");
  return plugin;
}

void Plugin::check(PJRT_Error* error, const char* what) const {
  if (error == nullptr) return;
  auto msg = PJRT_ARGS(PJRT_Error_Message_Args);
  msg.error = error;
  api_->PJRT_Error_Message(&msg);
  std::string text(msg.message, msg.message_size);
  auto code = PJRT_ARGS(PJRT_Error_GetCode_Args);
  code.error = error;
  api_->PJRT_Error_GetCode(&code);
  auto destroy = PJRT_ARGS(PJRT_Error_Destroy_Args);
  destroy.error = error;
  api_->PJRT_Error_Destroy(&destroy);
  // A plugin newer than our header may require args structs larger than ours.
  std::string hint;
  if (api_minor() > PJRT_API_MINOR && text.find("size: expected") != std::string::npos)
    hint = " (the plugin's PJRT API " + version_text(api_major(), api_minor()) + " is newer than torch_pjrt's " +
           version_text(PJRT_API_MAJOR, PJRT_API_MINOR) + ": rebuild torch_pjrt against its pjrt_c_api.h)";
  fail(what, " failed (PJRT error code ", static_cast<int>(code.code), "): ", text, hint);
}

}  // namespace torch_pjrt::pjrt
