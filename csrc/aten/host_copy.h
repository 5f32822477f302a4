// Host <-> device transfers (host_copy.cpp): copy_ where either side is a tpu tensor, reads of a tpu tensor to
// the host, and the buffers of an op's operands that are not storages. Internal to the aten layer.
#pragma once
#include <ATen/core/Tensor.h>

#include "pjrt/buffer.h"

namespace torch_pjrt {

struct Call;        // op_call.h
struct OperandRef;  // op_call.h

// dst.copy_(src) where either side is a tpu tensor; broadcasts and casts.
void copy_into(const at::Tensor& dst, const at::Tensor& src);
// A dense CPU copy of a tpu tensor (waits for the device).
at::Tensor to_host(const at::Tensor& tensor);
// A buffer holding exactly `t`'s elements in row-major order: the storage's own buffer when t is all of it,
// densely, else that of a dense copy (a program).
pjrt::BufferPtr dense_buffer(at::Tensor t, ElementType element);
// The buffer of operand `ref` of a call. Storage operands: the caller holds storage_mutex().
pjrt::BufferPtr operand_buffer(const Call& call, const OperandRef& ref);

}  // namespace torch_pjrt
