// A compiled program loaded on the client's devices (owned).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pjrt/buffer.h"

namespace torch_pjrt::pjrt {

class Client;

class LoadedExecutable {
 public:
  LoadedExecutable(std::shared_ptr<Plugin> plugin, PJRT_Device* device, PJRT_LoadedExecutable* exe);
  ~LoadedExecutable();
  LoadedExecutable(const LoadedExecutable&) = delete;
  LoadedExecutable& operator=(const LoadedExecutable&) = delete;

  size_t num_outputs() const { return num_outputs_; }
  // The devices the plugin runs this program on, in its argument-list order
  // (PJRT_LoadedExecutable_AddressableDevices): one per replica.
  std::vector<PJRT_Device*> addressable_devices() const;

  struct Result {
    std::vector<BufferPtr> outputs;
    std::unique_ptr<Event> done;  // fires when the program finished (or failed)
  };
  // Enqueues one execution on the executable's device; returns at once.
  // `donated` lists argument indices whose buffers the program may consume.
  Result execute(const std::vector<Buffer*>& args, const std::vector<int64_t>& non_donatable = {}) const;

  // One execution across several devices (a program compiled for N replicas):
  // `args[i]` are replica i's arguments, placed on `replica_devices[i]`; the
  // result lists outputs and completion events in the same replica order.
  struct ReplicatedResult {
    std::vector<std::vector<BufferPtr>> outputs;
    std::vector<std::unique_ptr<Event>> done;
  };
  ReplicatedResult execute_replicated(const std::vector<std::vector<Buffer*>>& args,
                                      const std::vector<PJRT_Device*>& replica_devices) const;

  // Bytes that DeserializeAndLoad on the same plugin version turns back into this.
  std::string serialize() const;

  // Executables alive in the process now (each holds memory maps of its JIT code).
  static int64_t alive();

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_Device* device_;
  PJRT_LoadedExecutable* exe_;
  size_t num_outputs_ = 0;
  // Output types, learned from the first execution's buffers (a compiled
  // program's are fixed): later results skip two plugin queries per buffer.
  mutable std::vector<std::pair<ElementType, std::vector<int64_t>>> output_types_;
  mutable std::mutex output_types_mutex_;
};

using ExecutablePtr = std::shared_ptr<LoadedExecutable>;

}  // namespace torch_pjrt::pjrt
