// The interface between PyTorch ops and their StableHLO lowerings. It holds no
// torch types, so lowerings compile without ATen headers: the executor
// (executor.cpp) implements Context over a real op call.
//
// A lowering is written for the functional form of an op. The executor runs it
// for the in-place (`add_`) and out= (`add.out`) forms too, converting each
// result to the output's dtype and writing it into the target tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
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

  // A flat cat (growth.cpp, flat_cat_of): elements of its result's
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

  // A runtime-length op (growth.cpp, runtime_length_of): tensors whose last
  // dim is the call's runtime length (a mask growing by a token per step) are
  // read padded to a bound that tensor_dims reports, so the program does not
  // depend on the length. This is that length (s64[]) when dim `dim` of
  // `name` is such a dim; nothing otherwise.
  virtual std::optional<Value> runtime_size(std::string_view name, int64_t dim) { return std::nullopt; }

  // The op's Tensor arguments in schema order, out= ones left out (lowerings written outside C++: register_lowering).
  virtual std::vector<std::string> tensor_arguments() const { return {}; }
  // Its other arguments the call gives a value other than the schema's default (add's alpha=2): a lowering that
  // sees only tensors must not run such a call (it would silently ignore them).
  virtual std::vector<std::string> non_default_arguments() const { return {}; }
  // The PJRT client's platform ("cpu", "cuda", "tpu"), which picked this lowering's rule.
  const std::string& platform() const;

  // Declares a runtime check (see RuntimeCheck); the executor reports the
  // first one that fails, naming the op and the user's line.
  void check(RuntimeCheck c) { checks.push_back(std::move(c)); }
  std::vector<RuntimeCheck> checks;
};

using LoweringFn = std::vector<Value> (*)(Context&);
using Lowering = std::function<std::vector<Value>(Context&)>;

// Checks and layout choices the CPU kernel makes in its body, outside its meta
// function, that the executor repeats for the op (op_planning.cpp: the hooks
// named after each flag). Bits of OpRule::cpu_rules.
enum CpuRule : uint32_t {
  kAlphaCheck = 1 << 0,       // BinaryOps' alpha_check (check_cpu_kernel_rules)
  kIndexPutValues = 1 << 1,   // values broadcast to the indexing result, same dtype (check_cpu_kernel_rules)
  kHostIndices = 1 << 2,      // host index tensors checked at the op (check_host_indices)
  kLayerNormStats = 1 << 3,   // saved stats in the parameters' dtype (apply_cpu_norm_stats_rules)
  kBatchNormStats = 1 << 4,   // ... and none in eval mode
  kConvLayout = 1 << 5,       // channels_last results (apply_cpu_layout_rules)
  kPool2dLayout = 1 << 6,     // the input's suggested memory format
  kPool3dLayout = 1 << 7,     // ... an unbatched 4-d input as a batch of one
  kKeepsOutShape = 1 << 8,    // a 1-d factory fills an out= of the right numel in its shape (keeps_out_shape)
  kCudaDtypes = 1 << 9,       // follows CUDA for dtypes the CPU kernel lacks: no dtype probe (histc)
};

// How the op's dispatcher entry is routed (registrations.cpp).
enum class Route : uint8_t {
  Default,      // the lowering's kernel where PyTorch has no generic one
  KeepGeneric,  // stays on PyTorch's generic kernel (copies across devices go through _copy_from)
  ToLowering,   // the generic kernel would fail on this device: sent to the lowering (or the CPU)
};

// One rule record per op: everything the executor, the registrations and the
// Python side know about an op. Keyed by the op's base name ("add" for
// add.Tensor, add_, add.out) or by name and overload ("mode.values"), for
// every platform or for one ("cpu", "cuda", "tpu": the PJRT client's).
// A rule may have no lowering (traits only: an op that runs on the CPU but
// whose CPU checks or routing still apply).
struct OpRule {
  Lowering fn;                // empty: no lowering
  bool bake_scalars = false;  // Scalar values decide shapes (arange): key on them
  // Arguments the op mutates although its schema does not say so
  // (native_batch_norm's running stats). The lowering returns their new values
  // after the op's returns.
  std::vector<std::string> extra_writes;
  // {argument, condition}: the op writes `argument` only when `condition` is given (not None), although its
  // schema marks it written always: the fused optimizers' grads, divided in place only by a grad_scale. Left
  // unwritten otherwise, so items that share a storage (FSDP2's gradients, views of one reduce-scatter
  // output) need not run on the CPU; the lowering returns no value for it then (output_count() says).
  std::vector<std::pair<std::string, std::string>> written_only_with;
  // `float` arguments passed as runtime operands (read with Context::scalar)
  // instead of keyed by value: a learning rate an LR scheduler changes.
  std::vector<std::string> runtime_floats;
  // Handles complex inputs and results (checked in tests/python/test_complex.py). Others never see them:
  // the executor sends such calls to the CPU.
  bool complex = false;
  // Each result element depends only on the inputs' elements at its position
  // (no reductions, no runtime checks): over whole capacity storages it runs
  // on their whole buffers (growth.cpp, capacity_elementwise_of).
  bool elementwise = false;
  // Runs on tensors padded along a runtime-length last dim (growth.cpp,
  // runtime_length_of), the padding holding this value: the identity of a
  // reduction, an index in range. Elementwise ops run so without one.
  std::optional<double> length_padding;
  uint32_t cpu_rules = 0;  // CpuRule bits
  // Memory overlap as the CPU kernel checks it (op_planning.cpp, check_memory_overlap). By default
  // TensorIterator's: no internal overlap of an output, no partial overlap of an output with an input.
  bool internal_overlap_ok = false;           // writes an overlapping output (a constant fill)
  bool inputs_overlap_unchecked = false;      // no output/input overlap check at all
  bool no_aliasing = false;                   // rejects even full aliasing of an output with any input
  std::vector<std::string> no_aliasing_with;  // ... with these inputs only
  Route route = Route::Default;
  bool skip_decomposition = false;  // never torch._decomp's decomposition (a device kernel of its own)
  // Set for lowerings registered from Python (torch_pjrt.register_lowering):
  // `prepare` runs at planning, on the calling thread, before the lowering;
  // `key_tag` joins the op's program keys, so a re-registration recompiles.
  std::function<void(Context&)> prepare;
  std::string key_tag;
  std::string platform;  // "" for every platform
};
using LoweringEntry = OpRule;

// The rule for an op: name then overload first, then the base name; a rule
// for `platform` before the portable one. Null if there is none.
const OpRule* find_rule(std::string_view base_name, std::string_view overload, std::string_view platform);
std::vector<std::string> lowered_op_names();
std::vector<std::string> rule_names(const std::string& platform = "");  // the rules' names ("mode.values", "add") for a platform
// The base name of an op ("aten::add_.Tensor", "add_", "aten::add" -> "add";
// "__iand__" keeps its underscores; other namespaces keep theirs) and its overload ("Tensor").
std::string base_name_of(std::string_view name);
std::string overload_of(std::string_view name);
// The PJRT client's platform, which platform rules match; set when the runtime starts.
void set_platform(const std::string& platform);
const std::string& current_platform();
// Bumped by every change to the rules (set_platform, register_rule): lookups cached per schema renew.
uint64_t rules_epoch();
// Adds or replaces a rule at runtime (torch_pjrt.register_lowering). The old
// record stays alive: plans made with it keep a valid pointer.
void register_rule(const std::string& name, OpRule rule);

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
// With `earlier_ok` (a chained program, runtime_checks.h): kEarlierCheckFailed
// where every own check passed and that is false.
constexpr int64_t kEarlierCheckFailed = -2;
Value check_status(Builder& b, const std::vector<RuntimeCheck>& checks,
                   const std::optional<Value>& earlier_ok = std::nullopt);

// Registration: each family file defines register_<family>(Table&), setting
// an op's traits where it registers the op:
//   add_lowering(t, "sum", lower_sum).complex_ok().length_padding(0);
//   rule(t, "index_fill").internal_overlap_ok();   // traits of an op without a lowering
struct Table;
class RuleRef {
 public:
  explicit RuleRef(OpRule& r) : r_(r) {}
  RuleRef& complex_ok() { r_.complex = true; return *this; }
  RuleRef& elementwise() { r_.elementwise = true; return *this; }
  RuleRef& length_padding(double v) { r_.length_padding = v; return *this; }
  RuleRef& cpu(uint32_t rules) { r_.cpu_rules |= rules; return *this; }
  RuleRef& internal_overlap_ok() { r_.internal_overlap_ok = true; return *this; }
  RuleRef& inputs_overlap_unchecked() { r_.inputs_overlap_unchecked = true; return *this; }
  RuleRef& no_aliasing() { r_.no_aliasing = true; return *this; }
  RuleRef& no_aliasing_with(std::vector<std::string> names) { r_.no_aliasing_with = std::move(names); return *this; }
  RuleRef& route(Route r) { r_.route = r; return *this; }
  RuleRef& skip_decomposition() { r_.skip_decomposition = true; return *this; }
  RuleRef& written_only_with(std::string arg, std::string condition) {
    r_.written_only_with.emplace_back(std::move(arg), std::move(condition));
    return *this;
  }
  OpRule& rule() { return r_; }

 private:
  OpRule& r_;
};
// Traits given with a lowering in a family's list: {"abs", lower_abs, kComplex | kElementwise}.
enum Trait : uint32_t { kComplex = 1, kElementwise = 2 };
struct Registration {
  const char* name;
  LoweringFn fn;
  uint32_t traits = 0;
};
// The rule named `name` ("index_fill", "mode.values"; `platform` "" for every platform), made if new.
RuleRef rule(Table& table, const std::string& name, const std::string& platform = "");
RuleRef add_lowering(Table& table, const std::string& name, LoweringFn fn, bool bake_scalars = false,
                     std::vector<std::string> extra_writes = {}, std::vector<std::string> runtime_floats = {});
void add_lowerings(Table& table, std::initializer_list<Registration> list, const std::string& platform = "");
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
void register_packed_attention(Table&);
void register_complex(Table&);
void register_external(Table&);  // torch_pjrt::jax_call (external.cpp)

// A function torch_pjrt::jax_call may call: `definitions` (func.func ops in
// generic form) defines `symbol`; looked up by `key`. A non-empty `unsupported`
// (why the device cannot run it) makes the op run on the CPU instead.
void register_external_function(const std::string& key, const std::string& symbol, const std::string& definitions,
                                const std::string& unsupported = "");
// A func.call of the function registered under `key`, whose results are the op's outputs as the meta
// kernel says (Unsupported where the device cannot run it).
std::vector<Value> call_external(Context& c, const std::string& key, const std::vector<Value>& operands);

}  // namespace torch_pjrt::lowering

namespace torch_pjrt::lowering {
// Thrown by a lowering for a case it does not handle; the op then runs on the
// CPU (counted and warned), never silently wrong.
struct Unsupported : std::runtime_error {
  explicit Unsupported(const std::string& what) : std::runtime_error(what) {}
};
}  // namespace torch_pjrt::lowering
