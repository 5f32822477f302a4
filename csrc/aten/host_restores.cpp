#include "aten/host_restores.h"

#include <algorithm>
#include <mutex>

#include "aten/device_context.h"

namespace torch_pjrt {
namespace {

std::function<void(const std::vector<int64_t>&)>& runner() {
  static auto* fn = new std::function<void(const std::vector<int64_t>&)>();
  return *fn;
}

thread_local int t_graph_locks = 0;
thread_local std::vector<int64_t> t_due;

// Moves the restores for programs from `failed` on to this thread's due list,
// newest first (so the oldest saved value stays). Under ctx.checks_mutex.
void take_due(DeviceContext& ctx, uint64_t failed) {
  auto& undos = ctx.host_undos;
  for (auto it = undos.rbegin(); it != undos.rend(); ++it)
    if (it->last_program >= failed) t_due.push_back(it->token);
  undos.erase(std::remove_if(undos.begin(), undos.end(), [&](const HostUndo& u) { return u.last_program >= failed; }),
              undos.end());
}

}  // namespace

void set_host_restore_runner(std::function<void(const std::vector<int64_t>&)> fn) { runner() = std::move(fn); }

void restore_if_failed(int device, bool ops_pending, int64_t token) {
  DeviceContext& ctx = device_context(device);
  uint64_t launched = ctx.programs.load();
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  // With no status unread, every program launched so far passed its checks: a
  // loop that never reads drops its older restores here.
  if (ctx.check_statuses.empty() && !ctx.failed_program) forget_restores(ctx, launched);
  ctx.host_undos.push_back(HostUndo{launched + (ops_pending ? 1 : 0), token});
}

std::vector<int64_t> registered_restores() {
  std::vector<int64_t> tokens;
  for (DeviceContext* ctx : started_device_contexts()) {
    std::lock_guard<std::mutex> lock(ctx->checks_mutex);
    for (const HostUndo& u : ctx->host_undos) tokens.push_back(u.token);
  }
  return tokens;
}

void forget_restores(DeviceContext& ctx, uint64_t settled) {
  auto& undos = ctx.host_undos;
  undos.erase(std::remove_if(undos.begin(), undos.end(), [&](const HostUndo& u) { return u.last_program <= settled; }),
              undos.end());
}

void restores_due(DeviceContext& ctx, uint64_t failed) {
  take_due(ctx, failed);
  ctx.host_undos.clear();  // the older ones' programs passed
}

void restore_failed_program(int device, uint64_t program) {
  DeviceContext& ctx = device_context(device);
  std::lock_guard<std::mutex> lock(ctx.checks_mutex);
  take_due(ctx, program);  // the older ones' programs may still fail a check
}

void run_due_restores() {
  if (t_graph_locks > 0 || t_due.empty()) return;
  std::vector<int64_t> due = std::exchange(t_due, {});
  if (runner()) runner()(due);
}

void enter_graph_lock() { ++t_graph_locks; }

void leave_graph_lock() {
  --t_graph_locks;
  run_due_restores();
}

}  // namespace torch_pjrt
