// An op call's signature (op_signature.cpp): which arguments the call writes, and the key its plan is cached
// under. The key holds everything a plan depends on (dtypes, shapes or capacities, strides, storage types and
// aliasing, baked Scalars, global state the meta kernels read), so two calls with one key share one plan.
// Internal to the aten layer.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "aten/growth.h"
#include "aten/op_call.h"

namespace torch_pjrt {

// Fills call.written, written_items and returns_written from the schema's facts. Returns false (with *why)
// when the op must run elsewhere (it writes a list it cannot, or two list items of one storage).
bool collect_written(Call& call, const SchemaFacts& facts, std::string* why);

// The key of a call's plan, and what keying it saw.
struct OpKey {
  std::string key;
  // Two arguments share a storage and some offset (or runtime stride) is not in the key: whether they overlap
  // (ATen's overlap errors) must be checked on every call.
  bool shared_storage = false, runtime_offset = false;
  bool complex = false;  // a complex tensor or Scalar argument
};
// Keys the call as `growth` decided (flat cat, capacity or runtime length: those sizes stay out of the key);
// sets call.device and call.keyed_storages from its tpu tensors. nullopt (with *why) when an argument cannot
// go to the device (a dtype XLA lacks, a boolean mask index, a tensor on another device type).
std::optional<OpKey> op_key(Call& call, const SchemaFacts& facts, const Growth& growth, std::string* why);
// Appends a number to a key as the key's own numbers are written.
void append_key_number(std::string& key, int64_t v);

// The call's non-Tensor arguments whose value is not the schema's default (add's alpha=2). A rule that sees
// only tensors (register_lowering) keys them and refuses such a call, which then runs on the CPU.
std::vector<std::string> non_default_arguments(const Call& call);

// torch.get_float32_matmul_precision() as the lowering's precision (part of the key and of the plan).
lowering::Builder::Precision float32_precision();

}  // namespace torch_pjrt
