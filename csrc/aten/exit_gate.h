// Device entry points at interpreter exit (torch-free; see bindings/interpreter_exit.cpp).
#pragma once

namespace torch_pjrt {

// From Python's atexit on (called on the exiting thread, without the GIL):
// every Python thread but the exiting one that enters or leaves an outermost
// device entry point, or is about to take the GIL inside one, parks forever
// instead (the process exit ends it), so no daemon thread runs the runtime
// while the process tears down. Waits up to `wait_ms` for threads already
// inside an entry point to leave (an op takes milliseconds, a compile seconds).
// `python_thread_without_gil` says whether the calling thread may park: a
// thread holding the GIL must not (it would block the exit), one without a
// Python thread state (autograd's device threads) need not.
void close_device_at_exit(bool (*python_thread_without_gil)(), int wait_ms);
// For code about to take the GIL, holding none of our locks.
void park_if_device_closed();
// Whether close_device_at_exit ran: background work must stop touching the plugin.
bool device_closed();

// On the stack of each device entry point, first (so destroyed last).
struct ExitGate {
  ExitGate();
  ~ExitGate();
  ExitGate(const ExitGate&) = delete;
  ExitGate& operator=(const ExitGate&) = delete;
};

}  // namespace torch_pjrt
