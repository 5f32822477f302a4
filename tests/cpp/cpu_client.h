// The CPU plugin's client for the C++ tests: PJRT_CPU_PLUGIN names the plugin
// .so (CMake sets it); one client per process, with `devices` virtual devices.
#pragma once
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "pjrt/client.h"

namespace torch_pjrt::test_support {

inline std::shared_ptr<pjrt::Client> cpu_client(int devices) {
  static std::shared_ptr<pjrt::Client> c = [devices] {
    const char* path = std::getenv("PJRT_CPU_PLUGIN");
    if (!path) throw std::runtime_error("set PJRT_CPU_PLUGIN to the CPU plugin .so");
    return pjrt::Client::create(pjrt::Plugin::load(path), {{"cpu_device_count", int64_t{devices}}});
  }();
  return c;
}

}  // namespace torch_pjrt::test_support
