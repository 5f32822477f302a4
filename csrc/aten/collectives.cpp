#include "aten/collectives.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "aten/device_context.h"
#include "aten/fused_graph.h"
#include "aten/growth.h"
#include "aten/host_copy.h"
#include "aten/lowerings/collectives.h"
#include "aten/op_call.h"
#include "graph/metrics.h"
#include "pjrt/error.h"

namespace torch_pjrt {
namespace {

using lowering::Collective;
using lowering::ReduceOp;

Collective parse_kind(const std::string& kind) {
  static const std::map<std::string, Collective> kinds{
      {"all_reduce", Collective::AllReduce},   {"all_gather", Collective::AllGather},
      {"reduce_scatter", Collective::ReduceScatter}, {"all_to_all", Collective::AllToAll},
      {"collective_permute", Collective::Permute},   {"broadcast", Collective::Broadcast}};
  auto it = kinds.find(kind);
  TORCH_CHECK_VALUE(it != kinds.end(), "unknown collective '", kind, "'");
  return it->second;
}

ReduceOp parse_op(const std::string& op) {
  static const std::map<std::string, ReduceOp> ops{{"sum", ReduceOp::Sum}, {"avg", ReduceOp::Avg},
                                                   {"max", ReduceOp::Max}, {"min", ReduceOp::Min},
                                                   {"prod", ReduceOp::Prod}};
  auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "unsupported reduce op '", op, "': expected sum, avg, max, min or prod");
  return it->second;
}

void check_inputs(const std::string& kind, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK_VALUE(!inputs.empty(), kind, ": needs one tensor per participating device, got none");
  std::set<int> devices;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    TORCH_CHECK_VALUE(t.defined() && t.device().type() == c10::DeviceType::PrivateUse1, kind, ": tensor ", i,
                      " is not a tpu tensor");
    TORCH_CHECK_VALUE(devices.insert(t.device().index()).second, kind, ": tensors ", i,
                      " and another are both on ", t.device(), "; each participant needs its own device");
    TORCH_CHECK_VALUE(t.scalar_type() == inputs[0].scalar_type(), kind, ": tensor ", i, " has dtype ",
                      t.scalar_type(), " but tensor 0 has ", inputs[0].scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == inputs[0].sizes(), kind, ": tensor ", i, " has shape ", t.sizes(),
                      " but tensor 0 has ", inputs[0].sizes());
  }
}


// The CPU plugin launches each device's part of a multi-device program from
// its thread pool, so two programs in flight at once may start in different
// orders on different devices; each then waits in its rendezvous for a replica
// stuck behind the other, and XLA aborts the process after 40 s (seen with
// four threads issuing collectives over overlapping devices). So a collective
// starts only once the previous one finished: this keeps its outputs
// (referenced until the next collective, which waits for them).
struct LaunchOrder {
  std::mutex mutex;
  std::vector<pjrt::BufferPtr> previous_outputs;
};
LaunchOrder& launch_order() {
  static auto* order = new LaunchOrder();  // never destroyed: buffers outlive static teardown
  return *order;
}

pjrt::LoadedExecutable::ReplicatedResult execute_in_order(const pjrt::LoadedExecutable& exe,
                                                          const std::vector<std::vector<pjrt::Buffer*>>& args,
                                                          const std::vector<PJRT_Device*>& devices) {
  LaunchOrder& order = launch_order();
  std::lock_guard<std::mutex> lock(order.mutex);
  for (const pjrt::BufferPtr& b : order.previous_outputs) {
    try {
      b->wait_ready();
    } catch (const pjrt::Error&) {
      // That collective failed; its outputs raise where they are read.
    }
  }
  order.previous_outputs.clear();
  auto result = exe.execute_replicated(args, devices);
  for (const auto& outputs : result.outputs) order.previous_outputs.insert(order.previous_outputs.end(), outputs.begin(), outputs.end());
  return result;
}

}  // namespace

std::vector<at::Tensor> run_collective(const std::string& kind, const std::vector<at::Tensor>& inputs,
                                       const std::string& op, int64_t dim,
                                       const std::vector<std::vector<int64_t>>& groups,
                                       const std::vector<std::pair<int64_t, int64_t>>& pairs, int64_t root) {
  check_not_forked();
  check_inputs(kind, inputs);
  lowering::CollectiveSpec spec;
  spec.kind = parse_kind(kind);
  spec.op = parse_op(op);
  spec.element = element_or_throw(inputs[0].scalar_type());
  spec.dims.assign(inputs[0].sizes().begin(), inputs[0].sizes().end());
  spec.replicas = static_cast<int64_t>(inputs.size());
  spec.groups = groups;
  spec.dim = dim;
  spec.pairs = pairs;
  spec.root = root;
  lowering::CollectiveProgram program;
  try {
    program = lowering::collective_program(spec);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, kind, ": ", e.what());
  }

  if (inputs[0].numel() == 0) {  // nothing to move: empty results of the collective's shape
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& t : inputs) outputs.push_back(at::empty(program.out_dims, t.options()));
    return outputs;
  }
  std::vector<size_t> devices;
  std::vector<PJRT_Device*> replica_devices;
  std::vector<pjrt::BufferPtr> held;  // referenced until enqueued: never donated meanwhile
  std::vector<std::vector<pjrt::Buffer*>> args;
  int64_t bytes = 0;
  for (const at::Tensor& t : inputs) {
    devices.push_back(static_cast<size_t>(t.device().index()));
    replica_devices.push_back(client().device(devices.back()));
    held.push_back(dense_buffer(t, spec.element));
    args.push_back({held.back().get()});
    bytes += static_cast<int64_t>(held.back()->byte_count());
  }
  pjrt::ExecutablePtr exe = compile_cache().get_or_compile_replicated(program.text, devices)->executable();
  auto result = execute_in_order(*exe, args, replica_devices);
  ++graph::metrics().executions;
  ++graph::metrics().collectives_in_xla;
  graph::metrics().collective_bytes += bytes;

  std::vector<at::Tensor> outputs;
  for (size_t r = 0; r < inputs.size(); ++r) {
    at::Tensor out = at::empty(program.out_dims, inputs[r].options());
    install_buffer(storage_state(out.storage()), std::move(result.outputs[r][0]));
    device_context(static_cast<int>(devices[r])).track(std::move(result.done[r]), exe);
    outputs.push_back(std::move(out));
  }
  return outputs;
}

}  // namespace torch_pjrt
