// The interface between PyTorch ops and their StableHLO lowerings. It holds no
// torch types, so lowerings compile without ATen headers: the executor
// (executor.cpp) implements Context over a real op call.
//
// A lowering is written for the functional form of an op. The executor runs it
// for the in-place (`add_`) and out= (`add.out`) forms too, converting each
// result to the output's dtype and writing it into the target tensor.
#pragma once
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "hlo/builder.h"

namespace torch_pjrt::lowering {

using hlo::Builder;
using hlo::Dims;
using hlo::TensorType;
using hlo::Value;

struct OutputMeta {
  ElementType element;
  Dims dims;
};

// A condition on the data that the CPU checks and XLA does not (an index in
// range, a nonzero integer divisor): XLA clamps or drops instead. The program
// computes it as a tiny extra output; the host raises the CPU's error at its
// next wait (executor.cpp, runtime_checks.h).
enum class CheckError { Index, Runtime };  // Python IndexError / RuntimeError, as the CPU raises
struct RuntimeCheck {
  Value ok;             // pred[]: the condition holds
  Value bad;            // s64[]: the offending value, for the message
  CheckError error;
  std::string message;  // the CPU's message; "{}" stands for `bad`, "{size}" for `size`
  std::optional<Value> size;  // s64[]: a size known at runtime only (Context::runtime_size)
};

// Argument access goes by the name in the op's schema ("self", "other", "dim").
class Context {
 public:
  explicit Context(Builder& builder) : b(builder) {}
  virtual ~Context() = default;
  Builder& b;

  virtual bool has(std::string_view name) const = 0;  // present and not None
  virtual bool is_tensor(std::string_view name) const = 0;
  virtual Value tensor(std::string_view name) = 0;
  virtual std::vector<std::optional<Value>> tensor_list(std::string_view name) = 0;  // Tensor[] or Tensor?[]
  // A Scalar argument as a 0-d value of `as`: a runtime operand, so changing
  // its value (a learning rate, a step count) never recompiles.
  virtual Value scalar(std::string_view name, ElementType as) = 0;
  virtual ElementType scalar_kind(std::string_view name) const = 0;  // S64, F64 or Pred
  virtual double scalar_value(std::string_view name) const = 0;        // baked: only for shape-like uses
  virtual int64_t int_arg(std::string_view name) const = 0;
  virtual double float_arg(std::string_view name) const = 0;
  virtual bool bool_arg(std::string_view name) const = 0;
  virtual Dims int_list(std::string_view name) const = 0;
  virtual std::vector<bool> bool_list(std::string_view name) const = 0;
  virtual std::string string_arg(std::string_view name) const = 0;
  virtual ElementType tensor_element(std::string_view name) const = 0;
  virtual Dims tensor_dims(std::string_view name) const = 0;

  // What PyTorch's meta kernel says the outputs are.
  virtual size_t output_count() const = 0;
  virtual const OutputMeta& output(size_t i) const = 0;
  // torch.result_type over these arguments (tensors and scalars).
  virtual ElementType promoted(const std::vector<std::string_view>& names) const = 0;
  // Threefry state ui64[2] from the op's generator (or the default one), which
  // advances by `count` so every draw is fresh and reproducible.
  virtual Value rng_state(int64_t count) = 0;

  // A flat cat (executor.cpp, flat_cat_of): elements of its result's
  // buffer (0: not one), its row count, and per piece its whole storage read
  // flat from the piece's start (values past the piece are whatever the
  // storage holds) with, for one row, its start in the result as a runtime
  // s64[] (none for the first piece), for several rows its element count.
  // Sizes stay out of the program, so a growing sequence reuses it.
  struct FlatPiece {
    Value data;
    std::optional<Value> position;
    std::optional<Value> length;
  };
  virtual int64_t flat_capacity() const { return 0; }
  virtual int64_t flat_rows() const { return 1; }
  virtual std::vector<FlatPiece> flat_pieces(std::string_view name) { return {}; }

  // A tensor that grows along `dim` inside a capacity storage (a KV cache
  // that row cats extend by a token per step), read with `dim` padded to the
  // most the storage can hold: lanes past the true size hold other data, and
  // the true size is a runtime s64[]. The program then depends on the
  // storage's capacity, not the length. Nothing: not such a tensor.
  struct Padded {
    Value value;
    Value size;
  };
  virtual std::optional<Padded> padded(std::string_view name, int64_t dim) { return std::nullopt; }

  // A runtime-length op (executor.cpp, runtime_length_of): tensors whose last
  // dim is the call's runtime length (a mask growing by a token per step) are
  // read padded to a bound that tensor_dims reports, so the program does not
  // depend on the length. This is that length (s64[]) when dim `dim` of
  // `name` is such a dim; nothing otherwise.
  virtual std::optional<Value> runtime_size(std::string_view name, int64_t dim) { return std::nullopt; }

  // Declares a runtime check (see RuntimeCheck); the executor reports the
  // first one that fails, naming the op and the user's line.
  void check(RuntimeCheck c) { checks.push_back(std::move(c)); }
  std::vector<RuntimeCheck> checks;
};

using LoweringFn = std::vector<Value> (*)(Context&);

struct LoweringEntry {
  LoweringFn fn;
  bool bake_scalars = false;  // Scalar values decide shapes (arange): key on them
  // Arguments the op mutates although its schema does not say so
  // (native_batch_norm's running stats). The lowering returns their new values
  // after the op's returns.
  std::vector<std::string> extra_writes;
  // `float` arguments passed as runtime operands (read with Context::scalar)
  // instead of keyed by value: a learning rate an LR scheduler changes.
  std::vector<std::string> runtime_floats;
  // Handles complex inputs and results. Others never see them: the executor
  // sends such calls to the CPU (lowerings/complex.cpp lists the ones that do).
  bool complex = false;
  // Each result element depends only on the inputs' elements at its position
  // (no reductions, no runtime checks): over whole capacity storages it runs
  // on their whole buffers (executor.cpp, capacity_elementwise_of).
  bool elementwise = false;
  // Runs on tensors padded along a runtime-length last dim (executor.cpp,
  // runtime_length_of), the padding holding this value: the identity of a
  // reduction, an index in range. Elementwise ops run so without one.
  std::optional<double> length_padding;
};

// Looks up the lowering for an op's base name ("add" for add.Tensor, add_,
// add.out); null if there is none.
const LoweringEntry* find_lowering(std::string_view base_name);
std::vector<std::string> lowered_op_names();

// Helpers shared by the lowering families.
Dims broadcast_shape(const Dims& a, const Dims& b);
Value broadcast_to(Builder& b, const Value& x, const Dims& dims);  // numpy rules
Value to(Builder& b, const Value& x, ElementType element, const Dims& dims);  // convert + broadcast
// A [rows, width] block whose (r, c) is flat[r * row_length + c], row_length a
// runtime s64[]: the rows of a buffer whose row length changes at runtime (row
// cats, Context::padded). The caller keeps every index in bounds.
Value gather_rows(Builder& b, const Value& flat, const Value& row_length, int64_t rows, int64_t width);
// The inverse: a flat buffer of `count` elements holding the first row_length
// lanes of each row of `block` [rows, width] in turn (what lies past them is
// unspecified). row_length is a runtime s64[] in [1, width].
Value pack_rows(Builder& b, const Value& block, const Value& row_length, int64_t count);
int64_t wrap_dim(int64_t dim, int64_t rank);
Dims all_dims(int64_t rank);
Value zeros_like(Builder& b, const Value& x);
Value scalar_like(Builder& b, double v, const Value& x);
// s64[3]: {index of the first failed check or -1, that check's bad value, its runtime size}.
Value check_status(Builder& b, const std::vector<RuntimeCheck>& checks);

// Registration: each family file defines register_<family>(Table&).
struct Table;
void allow_complex(Table& table, const std::string& name);  // the lowering handles complex values
void mark_elementwise(Table& table, const std::string& name);  // see LoweringEntry::elementwise
void allow_runtime_length(Table& table, const std::string& name, double padding);  // LoweringEntry::length_padding
void add_lowering(Table& table, const std::string& name, LoweringFn fn, bool bake_scalars = false,
                  std::vector<std::string> extra_writes = {}, std::vector<std::string> runtime_floats = {});
void register_pointwise(Table&);
void register_reduction(Table&);
void register_linalg(Table&);
void register_shape(Table&);
void register_indexing(Table&);
void register_nn(Table&);
void register_random(Table&);
void register_amp(Table&);
void register_optim(Table&);
void register_moe(Table&);
void register_attention(Table&);
void register_complex(Table&);  // last: marks complex-capable lowerings of the other families
void register_external(Table&);  // torch_pjrt::jax_call (external.cpp)

// A function torch_pjrt::jax_call may call: `definitions` (func.func ops in
// generic form) defines `symbol`; looked up by `key`. A non-empty `unsupported`
// (why the device cannot run it) makes the op run on the CPU instead.
void register_external_function(const std::string& key, const std::string& symbol, const std::string& definitions,
                                const std::string& unsupported = "");

}  // namespace torch_pjrt::lowering

namespace torch_pjrt::lowering {
// Thrown by a lowering for a case it does not handle; the op then runs on the
// CPU (counted and warned), never silently wrong.
struct Unsupported : std::runtime_error {
  explicit Unsupported(const std::string& what) : std::runtime_error(what) {}
};
}  // namespace torch_pjrt::lowering
