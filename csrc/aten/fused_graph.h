// Fused and lazy modes: ops recorded into one XLA graph per flush.
#pragma once
#include <memory>
#include <string>

#include "aten/op_call.h"

namespace torch_pjrt {

// Records the op instead of running it; pushes its (pending) outputs.
// Returns false (nothing recorded) when another thread changed an operand
// storage's type since the signature was taken: the caller plans again.
bool record(Call& call, const std::shared_ptr<CachedOp>& cached, torch::jit::Stack* stack, size_t nargs,
            const std::string& op_key);

}  // namespace torch_pjrt
