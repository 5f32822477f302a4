// Ops that run on the CPU (cpu_fallback.cpp): calls without a lowering, or that their lowering or meta kernel
// refuses. Internal to the aten layer.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>

namespace torch_pjrt {

// Runs the op's CPU kernel on host copies of its tpu tensors and copies written ones back; `why` says why it
// did not run on the device (counted and warned about once per op).
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::string& why);
// Counts a CPU fallback of op `name` and warns once per op.
void note_cpu_fallback(const std::string& name, const std::string& why);

}  // namespace torch_pjrt
