// Collectives across this process's tpu devices as ONE XLA program: one
// replica per participating device, compiled once per (collective, shape,
// dtype, device list) and executed with one argument list per device.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace torch_pjrt {

// `kind`: all_reduce, all_gather, reduce_scatter, all_to_all, collective_permute
// or broadcast; `op`: sum, avg, max, min or prod (reductions). inputs[i] is
// replica i's tensor: distinct tpu devices, one dtype and shape. Returns
// result[i] on inputs[i]'s device (new tensors; the program is enqueued, not
// waited for). `groups` lists replica indices (empty: all replicas, one group);
// `dim` is the gathered/scattered/split dim; `pairs` are (source, target)
// replicas; `root` the broadcast source's position in its group.
std::vector<at::Tensor> run_collective(const std::string& kind, const std::vector<at::Tensor>& inputs,
                                       const std::string& op, int64_t dim,
                                       const std::vector<std::vector<int64_t>>& groups,
                                       const std::vector<std::pair<int64_t, int64_t>>& pairs, int64_t root);

}  // namespace torch_pjrt
