// A device buffer (owned). Storage of every `tpu` tensor is one of these.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "pjrt/element_type.h"
#include "pjrt/event.h"

namespace torch_pjrt::pjrt {

class Buffer {
 public:
  Buffer(std::shared_ptr<Plugin> plugin, PJRT_Buffer* buffer);
  // A buffer whose type is known (a program's output): no queries to the plugin.
  Buffer(std::shared_ptr<Plugin> plugin, PJRT_Buffer* buffer, ElementType type, std::vector<int64_t> dims)
      : plugin_(std::move(plugin)), buffer_(buffer), type_(type), dims_(std::move(dims)) {}
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  PJRT_Buffer* raw() const { return buffer_; }
  ElementType element_type() const { return type_; }
  const std::vector<int64_t>& dims() const { return dims_; }
  int64_t element_count() const;
  size_t byte_count() const { return static_cast<size_t>(element_count()) * byte_size(type_); }

  // Copies the whole buffer, row-major, into `dst` (byte_count() bytes); waits.
  void to_host(void* dst) const;
  // The same copy, launched: `dst` and this buffer must live until the event fires.
  std::unique_ptr<Event> to_host_async(void* dst) const;
  // A copy of this buffer on another device of the same client, made by the plugin without the host
  // (PJRT_Buffer_CopyToDevice); launched, not waited for: the copy is ready when its ready event is.
  std::shared_ptr<Buffer> copy_to_device(PJRT_Device* device) const;
  // Waits until the value is computed; throws if the producing program failed.
  void wait_ready() const;
  // The plugin's address for the buffer's memory (often the device address):
  // equal addresses before and after a program show that it reused (donated) it.
  uintptr_t device_address() const;
  // True once a program consumed the buffer (donation).
  bool is_deleted() const;

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_Buffer* buffer_;
  ElementType type_;
  std::vector<int64_t> dims_;
};

using BufferPtr = std::shared_ptr<Buffer>;

}  // namespace torch_pjrt::pjrt
