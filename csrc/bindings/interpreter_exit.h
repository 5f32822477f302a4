// Interpreter exit with daemon threads still using the device (see
// interpreter_exit.cpp and docs/architecture.md, "Exit").
#pragma once

namespace torch_pjrt {

// At import: the terminate handler that parks daemon threads CPython ends during finalization.
void install_interpreter_exit_guard();
// Python's atexit (on the exiting thread, GIL held): closes the device to new work
// and waits, bounded and without the GIL, for threads inside device calls to leave.
void begin_interpreter_exit();

}  // namespace torch_pjrt
