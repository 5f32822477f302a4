// A PJRT completion event (owned).
#pragma once
#include <functional>
#include <memory>

#include "pjrt/plugin.h"

namespace torch_pjrt::pjrt {

class Event {
 public:
  Event(std::shared_ptr<Plugin> plugin, PJRT_Event* event) : plugin_(std::move(plugin)), event_(event) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Blocks until the event fires; throws the plugin's error if it failed.
  void wait();
  bool is_ready() const;
  // Calls `callback` (on a plugin thread, or at once) when the event fires,
  // failed or not. The callback must not call into PJRT or take the GIL.
  void on_ready(std::function<void()> callback);

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_Event* event_;
};

}  // namespace torch_pjrt::pjrt
