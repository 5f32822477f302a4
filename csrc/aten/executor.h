// Runs PyTorch ops on the device: every op without a dedicated kernel comes
// through `lowered_fallback`, which finds its lowering, compiles the program
// once per op signature and executes it; ops without a lowering run on the CPU.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "aten/device.h"

namespace torch_pjrt {

struct GraphRun;  // device_context.h
struct Work;      // device_context.h

void lowered_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// The op's name without namespace, overload or in-place underscore ("add").
const std::string& base_name(const c10::FunctionSchema& schema);  // "add" for aten::add_.Tensor
// Gives every lowered op an explicit PrivateUse1 kernel, so lowerings win over
// PyTorch's generic CompositeExplicitAutograd kernels. Call once all ops exist.
void register_lowered_kernels();
// torch.accelerator.Graph on tpu (graph_impl.cpp); after the backend's rename.
void register_graph_impl();

// Counts a CPU fallback of op `name` and warns once per op.
void note_cpu_fallback(const std::string& name, const std::string& why);

// dst.copy_(src) where either side is a tpu tensor; broadcasts and casts.
void copy_into(const at::Tensor& dst, const at::Tensor& src);
// A dense CPU copy of a tpu tensor (waits for the device).
at::Tensor to_host(const at::Tensor& tensor);
// Fused and lazy modes: runs the recorded graphs of every device (or of
// `device`) now (asynchronously).
void flush_pending();
void flush_pending(int device);
// Event.record without cutting the graph: takes the device's in-flight work
// and, if ops are pending, the run of its pending graph that will cover them
// (null if none), both under the graph's lock.
std::shared_ptr<GraphRun> pending_graph_run(int device, std::vector<std::shared_ptr<Work>>& in_flight);
// Runs the device's pending graph if `run` is still its pending run; after it,
// run.ran is true.
void flush_through(int device, const GraphRun& run);
// The storage's buffer for a reader, after the recorded graph if it writes
// the storage. Taken under the graph's lock, so no graph donates it between
// the flush and the reference (a referenced buffer is never donated).
pjrt::BufferPtr readable_buffer(const StorageState& st);
// Gives the storage a whole new value, after the recorded graph if it writes
// the storage (under the graph's lock: no op records in between).
void install_after_graph(StorageState& st, pjrt::BufferPtr buffer);
// Sets a storage's byte size (tensor resize_, untyped_storage().resize_),
// after the recorded graph if it uses the storage: its ops were keyed and must
// be lowered at the old size. Size 0 frees the buffer (FSDP2 frees unsharded
// parameters so); growth keeps it (reads pad it with zeros up to the size).
void resize_storage_after_graph(const c10::Storage& storage, size_t nbytes);
// Runs any recorded graph, then waits for all work enqueued so far on every
// device (or on `device`) and for non_blocking uploads; raises failed checks.
void synchronize();
void synchronize(int device);

// Test hook: op `name` ("aten::tanh"), when lowered into a fused graph, calls a
// kernel no plugin has, so the graph fails to compile. "" turns it off.
// `located`: a call the verifier rejects instead, an error naming the op's line.
void inject_compile_fault(const std::string& name, bool located = false);

}  // namespace torch_pjrt
