// A PJRT plugin: the shared object that exports GetPjrtApi, loaded once.
#pragma once
#include <pjrt_c_api.h>

#include <memory>
#include <string>

namespace torch_pjrt::pjrt {

// Whether torch_pjrt can use a plugin's function table, following the PJRT C
// API's versioning: the major version must equal our header's. A newer minor
// is fine (we call only functions our header knows, passing our struct
// sizes, which plugins accept or reject with a clear error). An older minor
// is fine if its table (struct_size bytes) holds every function we call.
// Returns "" when usable, else why not. Reads `api` only within struct_size.
std::string api_incompatibility(const PJRT_Api& api);

class Plugin {
 public:
  // Loads `path` (dlopen), checks api_incompatibility() and initializes it.
  static std::shared_ptr<Plugin> load(const std::string& path);

  const PJRT_Api* api() const { return api_; }
  const std::string& path() const { return path_; }
  int api_major() const { return api_->pjrt_api_version.major_version; }
  int api_minor() const { return api_->pjrt_api_version.minor_version; }

  // Throws Error with the plugin's message if `error` is non-null; frees it.
  void check(PJRT_Error* error, const char* what) const;

 private:
  Plugin(std::string path, void* handle, const PJRT_Api* api)
      : path_(std::move(path)), handle_(handle), api_(api) {}
  std::string path_;
  void* handle_;  // never dlclosed: plugins keep threads and atexit hooks
  const PJRT_Api* api_;
};

// fork(): the child inherits the parent's PJRT objects but none of the
// plugin's threads, so a call into the plugin may block forever. The fork
// handler marks the child; from then on the destructors of buffers, events,
// executables and clients call nothing (the child's exit reclaims memory).
void mark_forked_child();
bool in_forked_child();

// Zero-initialized args struct with struct_size set, as every PJRT call wants.
template <typename Args>
Args make_args(size_t struct_size) {
  Args args{};
  args.struct_size = struct_size;
  return args;
}
#define PJRT_ARGS(T) ::torch_pjrt::pjrt::make_args<T>(T##_STRUCT_SIZE)

}  // namespace torch_pjrt::pjrt
