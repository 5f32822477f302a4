// Interpreter exit with daemon threads.
//
// CPython 3.11-3.13 end a thread that takes the GIL after finalization began
// (take_gil -> PyThread_exit_thread) with pthread_exit. Its forced unwind runs
// through whatever C++ frames the thread is in; the frame that takes the GIL
// back after a device op is torch's pybind11::gil_scoped_release destructor,
// which is noexcept, so the unwind ends in std::terminate ("terminate called
// without an active exception", exit status 134). A daemon thread that loops
// over device ops spends most of its time with the GIL released inside torch,
// so this hit every exit. Neither frame is ours, and the gap between our code
// and torch's GIL re-acquisition cannot be closed from our side: parking
// threads at our own entry points (a first attempt) left it open.
//
// The fix is at the one place every such death passes: std::terminate. Our
// handler recognizes it (Python is finalizing, the caller is not the thread
// that finalizes, no C++ exception is active: a forced unwind) and parks the
// thread forever instead of aborting, as CPython 3.14 itself does with such
// threads (gh-87135); exit() then ends the process with the right status.
// The thread holds the GIL no more (take_gil dropped it) and none of our
// locks (nothing of ours takes the GIL while holding one). Every other
// terminate goes to the previous handler (torch's, then libstdc++'s).
//
// begin_interpreter_exit (atexit, before finalization) also stops device work:
// entry points park Python threads from then on (aten/exit_gate.h, ExitGate),
// and threads already inside one get a bounded time to leave, so no daemon
// thread runs the runtime while the process tears down. Known limit: threads
// without a Python state (autograd's device threads) are not parked, as the
// exiting thread may need them; a backward running at exit goes on until done.
#include "bindings/interpreter_exit.h"

#include <Python.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cxxabi.h>
#include <exception>

#include "aten/exit_gate.h"

namespace torch_pjrt {
namespace {

std::terminate_handler g_previous_terminate = nullptr;
std::atomic<bool> g_exit_began{false};
pthread_t g_exit_thread;  // written once before g_exit_began is set

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

bool is_exit_thread() { return g_exit_began && pthread_equal(pthread_self(), g_exit_thread); }

[[noreturn]] void park_forever() {
  for (;;) pause();
}

void on_terminate() {
  // A forced unwind (pthread_exit) has no C++ exception; a real error has one.
  // Without our atexit hook we cannot tell the finalizing thread: abort as before.
  if (g_exit_began && finalizing() && !is_exit_thread() && abi::__cxa_current_exception_type() == nullptr)
    park_forever();
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

// Python threads only, and only without the GIL: one parked holding it would block the exit.
bool python_thread_without_gil() { return PyGILState_GetThisThreadState() != nullptr && !PyGILState_Check(); }

}  // namespace

void install_interpreter_exit_guard() {
  std::terminate_handler previous = std::set_terminate(&on_terminate);
  if (previous != &on_terminate) g_previous_terminate = previous;
}

void begin_interpreter_exit() {
  g_exit_thread = pthread_self();
  g_exit_began = true;
  Py_BEGIN_ALLOW_THREADS  // threads finishing device work may need the GIL
  // Bounded, yet long enough for a compile in flight: a thread still inside
  // our code when exit() destroys static objects could crash.
  close_device_at_exit(&python_thread_without_gil, /*wait_ms=*/30000);
  Py_END_ALLOW_THREADS
}

}  // namespace torch_pjrt
