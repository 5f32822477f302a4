// What the executor knows about one op call, shared by the strict/debug path
// (executor.cpp) and fused graphs (fused_graph.cpp): the call's arguments, its
// cached plan (outputs, operands, lowering) and the helpers both paths use
// (defined in op_signature.cpp unless noted). Internal to the aten layer.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "aten/device.h"
#include "aten/lowering.h"
#include "aten/runtime_checks.h"

namespace torch_pjrt {

using lowering::OutputMeta;
using lowering::Value;

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

// Where an operand of a cached program comes from, replayed on every call.
struct OperandRef {
  // Offset: a tensor argument's nonzero storage offset, an s64[] like a Scalar.
  // Stride: its stride in dim `dim` (a strided view of a capacity storage).
  // Position: where item `item` of a flat cat's Tensor[] starts in its result (s64[]).
  // Length: item `item`'s element count (a flat cat of several rows).
  // Size: its size in dim `dim` (a tensor read padded, Context::padded).
  enum Kind { Storage, Host, Scalar, Rng, Offset, Stride, Position, Length, Size } kind;
  int arg = 0;
  int item = -1;  // index inside a Tensor[] argument, -1 for a plain Tensor
  ElementType element = ElementType::F32;
  uint64_t count = 0;  // random numbers drawn, for Rng
  int dim = 0;         // for Stride and Size
};
// A tensor argument's metadata (offset, stride, flat cat position or length): fixed by the inputs' metadata.
inline bool is_tensor_metadata(OperandRef::Kind kind) {
  return kind == OperandRef::Offset || kind == OperandRef::Stride || kind == OperandRef::Position ||
         kind == OperandRef::Length || kind == OperandRef::Size;
}

struct OutputPlan {
  bool absent = false;  // an undefined tensor (a gradient output_mask turned off)
  bool write = false;   // true: replaces the storage of argument `arg`
  int arg = 0;
  int item = -1;  // for a written Tensor[] argument (fused optimizers): which item
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> dims;
  // A new output's strides when the meta kernel gives it a dense layout other
  // than row-major (channels_last, a preserved input layout); empty: row-major.
  std::vector<int64_t> strides;
};

// A return_counts entry for an int return (see MetaResult::numbers).
constexpr int kNumberReturn = 2;

struct MetaResult {
  std::vector<OutputMeta> outputs;
  std::vector<int64_t> numbers;  // the int returns, in order: the meta kernel's values
  // An elementwise op over capacity storages (capacity_elementwise_of): its tensors are read, and its outputs
  // made and written, as flat buffers of this many elements. 0: no.
  int64_t capacity = 0;
  // A flat cat (flat_cat_of, decided when planned): its result's buffer holds
  // flat_capacity elements (0: not a flat cat), and its sizes come from each call, not from the plan.
  int64_t flat_capacity = 0, flat_rows = 1;
  // A runtime-length op (runtime_length_of, decided when keyed): tensors whose last dim is the call's length are
  // read padded to length_bound lanes; outputs marked in padded_outputs are made with the call's length as their
  // last dim and packed into capacity storages of rows * length_bound elements. 0: not one. The length is the
  // last dim of argument length_arg (item length_item), or arange's own (length_arg -1).
  int64_t length_bound = 0;
  int length_arg = -1, length_item = -1;
  std::vector<bool> padded_outputs;
  double length_padding = 0;  // LoweringEntry::length_padding
  std::vector<at::ScalarType> dtypes;
  std::vector<bool> absent;  // per output: an undefined return
  std::vector<int> return_counts;
  std::vector<std::vector<int64_t>> strides;  // per output: see OutputPlan::strides
};

struct CachedOp {
  graph::ProgramPtr program;  // strict/debug: the op's own program (fused modes need none)
  MetaResult meta;
  const lowering::LoweringEntry* entry = nullptr;
  bool operands_known = false;
  size_t compile_cost = 0;  // its lowering's Builder::compile_cost, known with its operands
  // torch.get_float32_matmul_precision() when planned (part of the op's key).
  lowering::Builder::Precision float32_precision = lowering::Builder::Precision::Highest;
  bool outputs_empty = false;  // every output has zero elements: nothing to run
  bool cat = false;  // aten::cat: its result is a grown storage (StorageState::grown)
  std::string unsupported;  // set when lowering failed: the op always falls back
  // Planned for one runtime length only (its outputs' shapes depend on the length in more than their last dim):
  // a call with another length plans again (run_lowered).
  int64_t exact_length = 0;
  std::vector<OperandRef> operands;
  std::vector<OutputPlan> outputs;
  std::vector<int> return_counts;  // tensors per schema return; -n-1: a Tensor[] of n; 0: undefined; kNumberReturn: an int
  // The runtime checks its lowering declares (null: none). Strict/debug: the
  // op's program returns their status after its outputs.
  CheckInfos checks;
};

// Every argument of a call, with the schema facts the executor needs.
// A storage as an op's signature saw it. A recorded op is lowered later, at
// these values: its storage may have been freed (resize_(0)) by then.
struct KeyedStorage {
  const StorageState* state;
  std::optional<lowering::TensorType> type;  // what it held (nothing: never written)
  size_t extent;                             // the bytes a program sees (extent_bytes)
};

struct Call {
  const c10::OperatorHandle& op;
  const c10::FunctionSchema& schema;
  std::vector<c10::IValue> args;
  std::vector<int> written;  // argument indices the op writes (in-place / out=)
  // True when the op returns the tensors it writes (add_, add.out); false when
  // it writes some arguments besides its returns (batch norm's running stats).
  bool returns_written = false;
  int device = -1;
  // Each tpu storage of the call as its signature saw it. Threads: running
  // the op checks the types again under storage_mutex() (storages_as_keyed)
  // and plans again if another thread gave a storage another type meanwhile.
  std::vector<KeyedStorage> keyed_storages;
  // Per `written` entry: the item of a written Tensor[] argument (which then
  // appears once per item in `written`), -1 for a Tensor argument.
  std::vector<int> written_items;
};

// Where a fused graph keeps the current value of each storage it touches.
struct GraphValues {
  std::unordered_map<const StorageState*, Value> values;
  // Storages the graph reads before writing: their buffer's type when recorded.
  std::unordered_map<const StorageState*, lowering::TensorType> inputs;
  // The parameter of each storage read before written (its value before the graph).
  std::unordered_map<const StorageState*, Value> originals;
  // Operands that are not storages (Scalars, CPU tensors, RNG states): the
  // graph passes each distinct buffer once. `operand_ids` lists, per such
  // operand of the op being emitted, its graph operand index; `params` holds
  // the parameter made for each index so far.
  const std::vector<int>* operand_ids = nullptr;
  size_t next_operand = 0;
  std::unordered_map<int, Value> params;
};

// `v` with `fn` applied to every tensor in it (a Tensor, Tensor[] or Tensor?[]).
template <typename Fn>
c10::IValue map_tensors(const c10::IValue& v, Fn fn) {
  if (v.isTensor()) return fn(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(fn(t));
    return out;
  }
  if (v.isList()) {
    auto list = v.toList();
    if (list.size() > 0 && (list.get(0).isTensor() || list.get(0).isNone())) {
      c10::List<std::optional<at::Tensor>> out;
      for (size_t i = 0; i < list.size(); ++i) {
        auto item = list.get(i);
        out.push_back(item.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(fn(item.toTensor())));
      }
      return out;
    }
  }
  return v;
}

// Boxed calls pass an absent Tensor? either as None or as an undefined tensor.
inline bool is_absent(const c10::IValue& v) { return v.isNone() || (v.isTensor() && !v.toTensor().defined()); }
// Whether the call writes argument `arg`.
inline bool is_written(const Call& call, int arg) {
  return std::find(call.written.begin(), call.written.end(), arg) != call.written.end();
}

// dtype mapping; element_or_throw raises for dtypes XLA has no type for.
std::optional<ElementType> element_of(at::ScalarType t);
at::ScalarType scalar_type_of(ElementType e);  // element_of's inverse
ElementType element_or_throw(at::ScalarType t);

// What every call of a schema needs, built once per schema and thread (name
// lookups and comparisons cost more than recording an op).
struct SchemaFacts {
  std::string op_name;    // "aten::add.Tensor"
  std::string base_name;  // "add": the lowering table's name
  const lowering::OpRule* rule = nullptr;         // the op's rule (lowering::find_rule); null: none
  const lowering::LoweringEntry* entry = nullptr;  // the rule if it has a lowering; null: no lowering
  uint64_t epoch = 0;                              // of the schemas and rules it was built from
  std::optional<size_t> indices_at, self_at;       // those arguments' positions
  std::vector<char> writes;         // per argument: the op writes it (alias info, or the entry's extra_writes)
  std::vector<char> runtime_float;  // per argument: one of the entry's runtime float operands
  bool is_copy = false;              // "copy" (copy_, copy): CPU sources may come in
  bool is_copy_ = false;             // aten::copy_ itself
  bool is_cat = false;               // aten::cat
};
const SchemaFacts& schema_facts(const c10::FunctionSchema& s);

// The call's entry for storage `st` (null: not one of its storages; a call has few: a linear scan).
template <typename CallT>
auto find_keyed(CallT& call, const StorageState* st) -> decltype(&call.keyed_storages[0]) {
  for (auto& keyed : call.keyed_storages)
    if (keyed.state == st) return &keyed;
  return nullptr;
}
const std::string& op_name(const c10::FunctionSchema& s);  // "aten::add.Tensor"
// The op's name without namespace, overload or in-place underscore ("add" for aten::add_.Tensor).
const std::string& base_name(const c10::FunctionSchema& s);
bool has_cpu_rule(const c10::FunctionSchema& s, uint32_t bits);  // the op's rule has one of these CpuRule bits
at::Tensor item_tensor(const c10::IValue& v, int item);
// The k-th written tensor of a call (an item of a written Tensor[] or a Tensor); `args` the call's or their metas.
at::Tensor written_tensor(const Call& call, const std::vector<c10::IValue>& args, size_t k);
std::optional<lowering::TensorType> storage_type(const StorageState& st);
std::optional<lowering::TensorType> storage_type_locked(const StorageState& st);  // caller holds storage_mutex()
std::optional<lowering::TensorType> checked_storage_type(const StorageState& st);  // raises if st lost its value
bool storages_as_keyed(const Call& call);                                          // caller holds storage_mutex()


// Lowers one op into `b` (call_context.cpp); in a fused graph, `graph` threads storage values
// from op to op. Returns one flat value per present output; the op's runtime
// checks go to `checks` when given.
std::vector<Value> emit_op(lowering::Builder& b, Call& call, const CachedOp& cached, GraphValues* graph,
                           std::vector<lowering::RuntimeCheck>* checks = nullptr);
// "aten::add.Tensor(Float[3, 4], Float[4])": an op and its tensor arguments, for errors.
std::string describe_call(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args);
// The location a lowering's ops carry: the op's name at the user's line.
hlo::Location op_location(const c10::FunctionSchema& schema, graph::SourceLocation location);

// Pops the call's arguments and pushes its returns (executor.cpp).
void push_returns(torch::jit::Stack* stack, size_t nargs, const CachedOp& cached, const std::vector<at::Tensor>& outs);

}  // namespace torch_pjrt
