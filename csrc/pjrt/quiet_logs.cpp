#include "pjrt/quiet_logs.h"

#include <unistd.h>

#include <cctype>
#include <cstring>
#include <string>

namespace torch_pjrt::pjrt {
namespace {

// absl's INFO line: "I" then MMDD, or its notice that logging is not initialized.
bool is_info_line(const std::string& line) {
  if (line.rfind("WARNING: All log messages before absl::InitializeLog()", 0) == 0) return true;
  if (line.size() < 6 || line[0] != 'I' || line[5] != ' ') return false;
  for (int i = 1; i < 5; ++i)
    if (!std::isdigit(static_cast<unsigned char>(line[i]))) return false;
  return true;
}

}  // namespace

QuietPluginLogs::QuietPluginLogs() {
  std::fflush(stderr);
  file_ = std::tmpfile();
  if (!file_) return;  // no temporary file: logs go where they went
  saved_ = ::dup(STDERR_FILENO);
  if (saved_ < 0 || ::dup2(::fileno(file_), STDERR_FILENO) < 0) {
    if (saved_ >= 0) ::close(saved_);
    saved_ = -1;
    std::fclose(file_);
    file_ = nullptr;
  }
}

QuietPluginLogs::~QuietPluginLogs() {
  if (!file_) return;
  std::fflush(stderr);
  ::dup2(saved_, STDERR_FILENO);
  ::close(saved_);
  std::rewind(file_);
  std::string kept;
  char buffer[4096];
  std::string line;
  while (std::fgets(buffer, sizeof buffer, file_)) {
    line += buffer;
    if (line.back() != '\n' && !std::feof(file_)) continue;  // a long line: read on
    if (!is_info_line(line)) kept += line;
    line.clear();
  }
  std::fclose(file_);
  if (!kept.empty()) {
    std::fwrite(kept.data(), 1, kept.size(), stderr);
    std::fflush(stderr);
  }
}

}  // namespace torch_pjrt::pjrt
