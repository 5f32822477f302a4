// Planning an op call (op_planning.cpp): PyTorch's meta kernel decides its outputs' shapes and dtypes
// (infer_meta), and the checks and choices CPU kernels make beyond their meta kernels are applied here too
// (the CPU check rules, probes of the CPU kernel on stand-ins), so a tpu op raises and lays out as the CPU's.
// Internal to the aten layer.
#pragma once
#include <memory>

#include "aten/op_call.h"

namespace torch_pjrt {

// The op's meta kernel (or the functional form's) raised: the CPU kernel decides (its error, or its result).
struct MetaRejected {};

// Runs the op's meta kernel: PyTorch's own shape, dtype and error checks.
MetaResult infer_meta(const Call& call);
// The op's plan: its outputs (from the meta kernel and the CPU rules) and return layout. Throws
// lowering::Unsupported, c10::NotImplementedError (no meta kernel) or MetaRejected when it cannot plan.
std::shared_ptr<CachedOp> plan(Call& call, const lowering::LoweringEntry& entry);
// Memory overlap between written and read tensors, by ATen's rules (planning checks it once per key; a call
// whose overlap the key cannot tell checks it on every call).
void check_memory_overlap(const Call& call);
// Index tensors held on the host are bounds-checked at the op, with the CPU's error (every call).
void check_host_indices(const Call& call);

}  // namespace torch_pjrt
