// Collectives as one StableHLO program run by N replicas (one per device of
// this process): each replica passes its input storage (a flat buffer) and
// gets its result as a flat buffer. Torch-free: the aten layer
// (aten/collectives.cpp) checks the tensors, flushes and runs the program.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hlo/builder.h"

namespace torch_pjrt::lowering {

enum class Collective { AllReduce, AllGather, ReduceScatter, AllToAll, Permute, Broadcast };
enum class ReduceOp { Sum, Avg, Max, Min, Prod };

struct CollectiveSpec {
  Collective kind = Collective::AllReduce;
  ReduceOp op = ReduceOp::Sum;    // AllReduce, ReduceScatter
  ElementType element = ElementType::F32;
  hlo::Dims dims;                 // every replica's (dense) input shape
  int64_t replicas = 1;
  hlo::Builder::ReplicaGroups groups;  // empty: one group of every replica
  int64_t dim = 0;                // AllGather, ReduceScatter, AllToAll: the dim gathered/scattered/split
  std::vector<std::pair<int64_t, int64_t>> pairs;  // Permute: (source, target) replicas
  int64_t root = 0;               // Broadcast: the source's position in its group
};

struct CollectiveProgram {
  std::string text;
  hlo::Dims out_dims;  // every replica's result shape
};

// Throws std::invalid_argument naming the problem for a spec no program computes
// (avg of integers, max of complex numbers, a dim not divisible by the group size, ...).
CollectiveProgram collective_program(const CollectiveSpec& spec);

const char* collective_name(Collective kind);

}  // namespace torch_pjrt::lowering
