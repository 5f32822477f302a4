// One in-memory cache of compiled programs, keyed by the StableHLO text, so
// two ops that lower to the same program share one executable.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>

#include "pjrt/client.h"

namespace torch_pjrt::graph {

class CompileCache {
 public:
  explicit CompileCache(std::shared_ptr<pjrt::Client> client) : client_(std::move(client)) {}
  pjrt::ExecutablePtr get_or_compile(const std::string& program, size_t device_index);
  size_t size() const { return entries_.size(); }
  void clear() { entries_.clear(); }

 private:
  std::shared_ptr<pjrt::Client> client_;
  std::unordered_map<std::string, pjrt::ExecutablePtr> entries_;  // key: device + program
};

}  // namespace torch_pjrt::graph
