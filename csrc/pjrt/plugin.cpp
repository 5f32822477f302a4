#include "pjrt/plugin.h"

#include <dlfcn.h>

#include <atomic>

#include "pjrt/error.h"

namespace torch_pjrt::pjrt {
namespace {
std::atomic<bool> g_forked_child{false};
}  // namespace

void mark_forked_child() { g_forked_child = true; }
bool in_forked_child() { return g_forked_child; }

std::shared_ptr<Plugin> Plugin::load(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  PJRT_CHECK(handle, "could not load PJRT plugin '", path, "': ", dlerror());
  using GetApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetApiFn>(dlsym(handle, "GetPjrtApi"));
  PJRT_CHECK(get_api, "'", path, "' is not a PJRT plugin: it exports no GetPjrtApi");
  const PJRT_Api* api = get_api();
  PJRT_CHECK(api, "GetPjrtApi in '", path, "' returned null");
  const auto& v = api->pjrt_api_version;
  PJRT_CHECK(v.major_version == PJRT_API_MAJOR,
             "PJRT plugin '", path, "' has API major version ", v.major_version,
             " but torch_pjrt was built against ", PJRT_API_MAJOR, ".", PJRT_API_MINOR);
  PJRT_CHECK(v.minor_version <= PJRT_API_MINOR,
             "PJRT plugin '", path, "' has API version ", v.major_version, ".",
             v.minor_version, ", newer than the header torch_pjrt was built with (",
             PJRT_API_MAJOR, ".", PJRT_API_MINOR,
             "); rebuild torch_pjrt against that plugin's pjrt_c_api.h");
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
  fail(what, " failed (PJRT error code ", static_cast<int>(code.code), "): ", text);
}

}  // namespace torch_pjrt::pjrt
