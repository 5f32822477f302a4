#include "aten/runtime_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <iterator>
#include <mutex>

#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/host_restores.h"
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

void defer_checks(int device, uint64_t program, pjrt::BufferPtr status, CheckInfos checks,
                  std::vector<graph::SourceLocation> locations) {
  DeviceContext& ctx = device_context(device);
  ctx.checks_seen = true;
  bool full;
  {
    std::lock_guard<std::mutex> lock(ctx.checks_mutex);
    ctx.check_statuses.push_back(
        PendingStatus{std::move(status), program, std::move(checks), std::move(locations)});
    full = ctx.check_statuses.size() >= kMaxPending;
  }
  if (full) raise_failed_checks(device);
}

namespace {
std::atomic<bool> g_keep_values{true};
}  // namespace

bool keep_values_on_failed_checks() { return g_keep_values.load(std::memory_order_relaxed); }

bool set_keep_values_on_failed_checks(bool on) { return g_keep_values.exchange(on); }

uint64_t begin_program(int device) { return ++device_context(device).programs; }

uint64_t current_program(int device) { return device_context(device).programs.load(); }

namespace {

using Pending = std::vector<std::pair<DeviceContext*, PendingStatus>>;

// Taking statuses, reading them and deciding (raise, requeue, mark the failed
// program, forget undos) is one step: a second thread between a take and a
// requeue would see no statuses and forget a failure that is still pending.
std::recursive_mutex& settle_mutex() {
  static auto* mutex = new std::recursive_mutex();
  return *mutex;
}

// Takes every pending status of `device` (-1: of every device), in order.
Pending take_pending(int device) {
  Pending pending;
  for (DeviceContext* ctx : started_device_contexts()) {
    if (device >= 0 && ctx->index != device) continue;
    std::lock_guard<std::mutex> lock(ctx->checks_mutex);
    for (PendingStatus& p : ctx->check_statuses) pending.emplace_back(ctx, std::move(p));
    ctx->check_statuses.clear();
  }
  return pending;
}

// Puts statuses back ahead of newer ones, in their order.
void requeue(Pending& items) {
  for (auto it = items.rbegin(); it != items.rend(); ++it) {
    std::lock_guard<std::mutex> lock(it->first->checks_mutex);
    it->first->check_statuses.insert(it->first->check_statuses.begin(), std::move(it->second));
  }
}

// Reads the statuses (waiting for their programs). Returns per status its
// {failed check or -1, bad value, runtime size}.
std::vector<std::array<int64_t, 3>> read_statuses(const Pending& pending) {
  std::vector<std::array<int64_t, 3>> out(pending.size(), {-1, 0, 0});
  for (size_t k = 0; k < pending.size(); ++k) {
    ++graph::metrics().check_status_reads;
    try {
      pending[k].second.status->to_host(out[k].data());
    } catch (const pjrt::Error&) {
      out[k][0] = -1;  // the program itself failed: its completion event reports that
    }
  }
  return out;
}

// Every check of `ctx`'s programs up to `settled` passed: nothing to undo.
void forget_undos(DeviceContext& ctx, uint64_t settled) {
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  ctx.failed_program = 0;
  forget_restores(ctx, settled);
}

// Raising `failed`'s error: host state changed since is due to be restored,
// and writes stay dropped while `next_failed` (0: none) is unread.
void undo_failed(DeviceContext& ctx, uint64_t failed, uint64_t next_failed) {
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  restores_due(ctx, failed);
  ctx.failed_program = next_failed;
}

// The CPU's message for a failed status (no op or line).
std::string cpu_message(const PendingStatus& p, const std::array<int64_t, 3>& status) {
  return with_values(p.checks->at(static_cast<size_t>(status[0])).message, status[1], status[2]);
}

std::string failure_message(const PendingStatus& p, const std::array<int64_t, 3>& status) {
  const CheckInfo& info = p.checks->at(static_cast<size_t>(status[0]));
  graph::SourceLocation location = p.locations.at(info.checked_op);
  return c10::str(cpu_message(p, status), " (in ", info.op, ", recorded at ",
                  graph::describe_source_location(location),
                  "; found by a check on the device, raised at the next host wait. Every tpu tensor the steps since "
                  "wrote, optimizer step counts, LR schedulers and GradScalers are as before it; other host state your "
                  "loop changed since that line is not put back)");
}

}  // namespace

// Raises the first failed check; other failed ones stay queued for the next
// wait, so a second bad op's result never reads as if nothing happened.
void raise_failed_checks(int device) {
  std::unique_lock<std::recursive_mutex> settling(settle_mutex());
  std::vector<std::pair<DeviceContext*, uint64_t>> settled;  // programs launched before the statuses are taken
  for (DeviceContext* ctx : started_device_contexts())
    if (device < 0 || ctx->index == device) settled.emplace_back(ctx, ctx->programs.load());
  Pending pending = take_pending(device);
  std::vector<std::array<int64_t, 3>> status = read_statuses(pending);
  size_t failed = pending.size();
  Pending later;  // failed ones after the first, requeued
  for (size_t k = 0; k < pending.size(); ++k) {
    if (status[k][0] < 0) continue;
    if (failed == pending.size()) {
      failed = k;
      continue;
    }
    // The same bad value found again on the same device (the backward of
    // the failed op, another op on the same index) is the same error, and
    // everything since the first was dropped: raised once, as on the CPU.
    bool same = pending[k].first == pending[failed].first &&
                cpu_message(pending[k].second, status[k]) == cpu_message(pending[failed].second, status[failed]);
    if (!same) later.push_back(std::move(pending[k]));
  }
  for (auto [ctx, programs] : settled) {
    if (failed < pending.size() && pending[failed].first == ctx) continue;
    bool still_failed = std::any_of(later.begin(), later.end(), [&](const auto& l) { return l.first == ctx; });
    if (!still_failed) forget_undos(*ctx, programs);
  }
  if (failed == pending.size()) return;
  const PendingStatus& first = pending[failed].second;
  DeviceContext* ctx = pending[failed].first;
  uint64_t next_failed = 0;
  for (const auto& l : later)
    if (l.first == ctx && !next_failed) next_failed = l.second.program;
  undo_failed(*ctx, first.program, next_failed);
  std::string message = failure_message(first, status[failed]);
  lowering::CheckError error = first.checks->at(static_cast<size_t>(status[failed][0])).error;
  requeue(later);
  settling.unlock();
  run_due_restores();
  if (error == lowering::CheckError::Index) TORCH_CHECK_INDEX(false, message);
  TORCH_CHECK(false, message);
}

uint64_t writes_dropped_before(int device, uint64_t oldest_born) {
  if (!keep_values_on_failed_checks()) return 0;
  DeviceContext& ctx = device_context(device);
  {
    std::lock_guard<std::mutex> lock(ctx.checks_mutex);
    if (ctx.failed_program) return ctx.failed_program;
    if (ctx.check_statuses.empty() || oldest_born >= ctx.check_statuses.front().program) return 0;
  }
  std::lock_guard<std::recursive_mutex> settling(settle_mutex());
  {
    std::lock_guard<std::mutex> lock(ctx.checks_mutex);  // another thread may have settled meanwhile
    if (ctx.failed_program) return ctx.failed_program;
    if (ctx.check_statuses.empty() || oldest_born >= ctx.check_statuses.front().program) return 0;
  }
  uint64_t programs = ctx.programs.load();
  Pending pending = take_pending(device);
  std::vector<std::array<int64_t, 3>> status = read_statuses(pending);
  auto failed = std::find_if(status.begin(), status.end(), [](const auto& s) { return s[0] >= 0; });
  if (failed == status.end()) {
    forget_undos(ctx, programs);
    return 0;
  }
  uint64_t program = pending[static_cast<size_t>(failed - status.begin())].second.program;
  {
    std::lock_guard<std::mutex> lock(ctx.checks_mutex);
    ctx.failed_program = program;
  }
  requeue(pending);  // still raised at the user's next wait
  return program;
}

bool checks_unread(int device) {
  DeviceContext& ctx = device_context(device);
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  return !ctx.check_statuses.empty();
}

bool chains_statuses(int device) {
  return keep_values_on_failed_checks() && device_context(device).checks_seen.load(std::memory_order_relaxed);
}

pjrt::BufferPtr chained_status(int device) {
  DeviceContext& ctx = device_context(device);
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  if (!ctx.check_statuses.empty()) return ctx.check_statuses.back().status;
  if (!ctx.passed_status) {
    const int64_t passed[3] = {-1, 0, 0};
    ctx.passed_status = client().buffer_from_host(passed, ElementType::S64, {3}, device);
  }
  return ctx.passed_status;
}

}  // namespace torch_pjrt
