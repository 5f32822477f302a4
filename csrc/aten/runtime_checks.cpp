#include "aten/runtime_checks.h"

#include <c10/util/Exception.h>

#include <iterator>
#include <mutex>

#include "aten/device_context.h"
#include "graph/metrics.h"
#include "pjrt/error.h"

namespace torch_pjrt {
namespace {

// A loop that never waits still reads its statuses now and then, so they do
// not pile up; by then their programs have long finished.
constexpr size_t kMaxPending = 1024;

std::string with_values(std::string message, int64_t bad, int64_t size) {
  auto at = message.find("{}");
  if (at != std::string::npos) message.replace(at, 2, std::to_string(bad));
  at = message.find("{size}");
  if (at != std::string::npos) message.replace(at, 6, std::to_string(size));
  return message;
}

}  // namespace

void add_check_infos(std::vector<CheckInfo>& into, const std::vector<lowering::RuntimeCheck>& checks,
                     const std::string& op, size_t checked_op) {
  for (const auto& c : checks) into.push_back(CheckInfo{c.error, c.message, op, checked_op});
}

void defer_checks(int device, pjrt::BufferPtr status, CheckInfos checks, std::vector<graph::SourceLocation> locations) {
  DeviceContext& ctx = device_context(device);
  bool full;
  {
    std::lock_guard<std::mutex> lock(ctx.checks_mutex);
    ctx.check_statuses.push_back(PendingStatus{std::move(status), std::move(checks), std::move(locations)});
    full = ctx.check_statuses.size() >= kMaxPending;
  }
  if (full) raise_failed_checks(device);
}

// Raises the first failed check; other failed ones stay queued for the next
// wait, so a second bad op's result never reads as if nothing happened.
void raise_failed_checks(int device) {
  std::vector<std::pair<DeviceContext*, PendingStatus>> pending;
  for (DeviceContext* ctx : started_device_contexts()) {
    if (device >= 0 && ctx->index != device) continue;
    std::lock_guard<std::mutex> lock(ctx->checks_mutex);
    for (PendingStatus& p : ctx->check_statuses) pending.emplace_back(ctx, std::move(p));
    ctx->check_statuses.clear();
  }
  if (pending.empty()) return;
  const PendingStatus* failed = nullptr;
  int64_t first[3] = {-1, 0, 0};
  std::vector<std::pair<DeviceContext*, PendingStatus>> later;
  for (auto& [ctx, p] : pending) {
    int64_t status[3] = {-1, 0, 0};
    ++graph::metrics().check_status_reads;
    try {
      p.status->to_host(status);
    } catch (const pjrt::Error&) {
      continue;  // the program itself failed: its completion event reports that
    }
    if (status[0] < 0) continue;
    if (failed) {
      later.emplace_back(ctx, std::move(p));
      continue;
    }
    failed = &p;
    first[0] = status[0];
    first[1] = status[1];
    first[2] = status[2];
  }
  if (!failed) return;
  const CheckInfo& info = failed->checks->at(static_cast<size_t>(first[0]));
  graph::SourceLocation location = failed->locations.at(info.checked_op);
  std::string message = c10::str(with_values(info.message, first[1], first[2]), " (in ", info.op, ", recorded at ",
                                 graph::describe_source_location(location),
                                 "; found by a check on the device, raised at the next host wait)");
  for (auto it = later.rbegin(); it != later.rend(); ++it) {  // ahead of newer statuses, in their order
    std::lock_guard<std::mutex> lock(it->first->checks_mutex);
    it->first->check_statuses.insert(it->first->check_statuses.begin(), std::move(it->second));
  }
  if (info.error == lowering::CheckError::Index) TORCH_CHECK_INDEX(false, message);
  TORCH_CHECK(false, message);
}

}  // namespace torch_pjrt
