// A PJRT completion event (owned).
#pragma once
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

 private:
  std::shared_ptr<Plugin> plugin_;
  PJRT_Event* event_;
};

}  // namespace torch_pjrt::pjrt
