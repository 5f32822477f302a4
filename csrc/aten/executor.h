// Runs PyTorch ops on the device: every op without a dedicated kernel comes
// through `lowered_fallback`, which finds its lowering, compiles the program
// once per op signature and executes it; ops without a lowering run on the CPU.
// (executor.cpp; its steps live in op_signature, op_planning, growth,
// call_context, host_copy and cpu_fallback.)
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>

namespace torch_pjrt {

void lowered_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);
// Runs the op on the device when it lowers. Returns false (stack untouched, *why set) when it must run
// elsewhere (the CPU fallback).
bool run_lowered(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::string* why);
// run_lowered, else the CPU fallback.
void run_or_throw(const c10::OperatorHandle& op, torch::jit::Stack* stack);
c10::OperatorHandle find_op(const char* name, const char* overload);

// Gives every lowered op an explicit PrivateUse1 kernel, so lowerings win over
// PyTorch's generic CompositeExplicitAutograd kernels. Call once all ops exist.
namespace lowering { struct OpRule; }
void register_lowered_kernels(const lowering::OpRule* overriding = nullptr);
// torch.accelerator.Graph on tpu (graph_impl.cpp); after the backend's rename.
void register_graph_impl();

}  // namespace torch_pjrt
