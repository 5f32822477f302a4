// Host state a failed step changed is put back when its error is raised.
//
// A device error (a failed runtime check, a fused graph that fails to compile
// or to run) surfaces at the next host wait, after Python already ran more of
// the step: an optimizer's CPU step count, an LR scheduler's count, a
// GradScaler's per-optimizer stage. Python saves such state before changing
// it and registers a restore (a token) for the programs the step launches;
// the restores of a failed program run, newest first (so the oldest saved
// value stays), before its error reaches the user. They are Python code, so
// they run once the raising thread holds no graph lock.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace torch_pjrt {

class DeviceContext;

// One registered restore: due if a program up to `last_program` fails.
struct HostUndo {
  uint64_t last_program = 0;
  int64_t token = 0;
};

// Python's runner: called with due tokens, newest first (bindings set it).
void set_host_restore_runner(std::function<void(const std::vector<int64_t>&)> runner);

// Registers restore `token` for a step on `device` whose last program is the
// one launched last, or the next one when `ops_pending` (its pending graph).
void restore_if_failed(int device, bool ops_pending, int64_t token);
// Tokens still registered on any device (Python forgets the others).
std::vector<int64_t> registered_restores();

// Under ctx.checks_mutex (runtime_checks.cpp): programs up to `settled`
// passed, their restores are dropped; or a program `failed` failed, the
// restores from it on become due on this thread.
void forget_restores(DeviceContext& ctx, uint64_t settled);
void restores_due(DeviceContext& ctx, uint64_t failed);
// Program `program` of `device` failed to compile or run (a fused graph).
void restore_failed_program(int device, uint64_t program);

// Runs this thread's due restores unless it holds a graph lock (then the
// lock's release runs them).
void run_due_restores();
// The graph lock's bookkeeping (fused_graph.cpp's GraphLock).
void enter_graph_lock();
void leave_graph_lock();

}  // namespace torch_pjrt
