// Growth (growth.cpp): shapes that change every step of generation without a new program. A flat cat's result,
// the results of elementwise ops over such results, and the results of runtime-length ops live in capacity
// storages (buffers rounded up to a bucket) whose key holds the capacity, not the size. Also the tensors an op
// makes for its outputs, since growth decides which of them are capacity storages. Internal to the aten layer.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "aten/op_call.h"

namespace torch_pjrt {

// A flat cat is `aten::cat` of contiguous tpu pieces of one dtype: with only size-1 dims
// before its dim, its result is the pieces' flat concatenation; otherwise
// each of its rows (the product of those dims) is the rows' concatenation.
struct FlatCat {
  int64_t capacity = 0;  // elements of its result's buffer; 0: the call is not a flat cat
  int64_t rows = 1;      // the product of the dims before the cat dim (1: one flat row)
};
// A runtime-length op: its tensors' last dims hold a length that changes per
// call (a mask growing by a token per step), computed padded so that its
// program does not depend on it. Its tensors are 0-d, or have last dim 1, or
// have the length as their last dim and cover a capacity storage (read padded
// to `bound` lanes), or are fresh written ones. `length` 0: not one.
struct RuntimeLength {
  int64_t length = 0, bound = 0;
  int arg = -1, item = -1;  // the first padded tensor (-1: arange, whose Scalars give the length)
};
// How a call grows, decided before it is keyed: at most one of a flat cat, an elementwise op over capacity
// storages of `elementwise_capacity` elements (capacity_elementwise_of), or a runtime-length op.
struct Growth {
  FlatCat flat;
  int64_t elementwise_capacity = 0;
  RuntimeLength length;
};
Growth growth_of(const Call& call, const lowering::LoweringEntry& entry);
// Records the growth in a fresh plan (its flat capacity, capacity or padded outputs); may run the meta kernel
// again (a runtime-length op).
void plan_growth(const Call& call, CachedOp& cached, const Growth& growth);
// Written tensors take the plan's shapes: out= tensors the result's, runtime-length outputs this call's length,
// and fresh destinations of a capacity op become capacity storages.
void shape_written_outputs(Call& call, const CachedOp& cached);
// The length of a call planned as a runtime-length op (MetaResult::length_bound).
int64_t runtime_length(const Call& call, const MetaResult& meta);

// Ops run while one exists make exact-size results: no capacity storages (flat cats, capacity elementwise and
// runtime-length ops run as plain ones). A collective needs a buffer of exactly a tensor's elements.
class ExactShapes {
 public:
  ExactShapes();
  ~ExactShapes();
  ExactShapes(const ExactShapes&) = delete;
  ExactShapes& operator=(const ExactShapes&) = delete;

 private:
  bool previous_;
};

// The op's outputs: its written arguments, or new tensors on the call's device (capacity storages for a
// growing result).
std::vector<at::Tensor> output_tensors(const Call& call, const CachedOp& cached);
// What the empty kernels make on tpu device `device` (no strides: contiguous, or `memory_format`), without
// a dispatch.
at::Tensor new_device_tensor(c10::IntArrayRef sizes, std::optional<c10::IntArrayRef> strides, at::ScalarType dtype,
                             int device, std::optional<c10::MemoryFormat> memory_format = std::nullopt);

}  // namespace torch_pjrt
