#include "aten/exit_gate.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace torch_pjrt {
namespace {

std::atomic<bool> g_closed{false};
std::atomic<bool (*)()> g_may_park{nullptr};
std::thread::id g_exit_thread;             // written before g_closed is set
std::atomic<int> g_threads_inside{0};      // threads inside an outermost entry point
thread_local int t_depth = 0;              // entry points this thread is inside

void park_if_closed() {
  if (!g_closed || std::this_thread::get_id() == g_exit_thread) return;
  bool (*may_park)() = g_may_park.load();
  if (!may_park || !may_park()) return;
  if (t_depth > 0) --g_threads_inside;  // the exit need not wait for a parked thread
  for (;;) pause();
}

}  // namespace

void close_device_at_exit(bool (*python_thread_without_gil)(), int wait_ms) {
  g_may_park = python_thread_without_gil;
  g_exit_thread = std::this_thread::get_id();
  g_closed = true;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (g_threads_inside > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void park_if_device_closed() { park_if_closed(); }

bool device_closed() { return g_closed; }

ExitGate::ExitGate() {
  if (t_depth == 0) park_if_closed();
  if (t_depth++ == 0) ++g_threads_inside;
}

ExitGate::~ExitGate() {
  if (--t_depth == 0) {
    --g_threads_inside;
    park_if_closed();
  }
}

}  // namespace torch_pjrt
