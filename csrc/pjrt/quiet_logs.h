// Plugins log through absl before anything initialized absl logging: at start
// they print INFO lines ("I0000 ... cpu_device_count set via create_options")
// and absl's notice about that to stderr. Those say nothing to a PyTorch user,
// so plugin start-up runs inside QuietPluginLogs; warnings and errors are kept.
#pragma once
#include <cstdio>

namespace torch_pjrt::pjrt {

class QuietPluginLogs {
 public:
  QuietPluginLogs();   // stderr (fd 2) goes to a temporary file
  ~QuietPluginLogs();  // stderr back; the lines that are not absl INFO lines are written to it
  QuietPluginLogs(const QuietPluginLogs&) = delete;
  QuietPluginLogs& operator=(const QuietPluginLogs&) = delete;

 private:
  int saved_ = -1;
  std::FILE* file_ = nullptr;
};

}  // namespace torch_pjrt::pjrt
