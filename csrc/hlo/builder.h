// Builds one StableHLO module as MLIR text: a single public @main function.
// Ops are emitted in MLIR's generic form, which is uniform and stable across
// StableHLO versions. Values are SSA names tagged with their tensor type.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pjrt/element_type.h"

namespace torch_pjrt::hlo {

using Dims = std::vector<int64_t>;

struct TensorType {
  ElementType element;
  Dims dims;
  int64_t element_count() const;
  std::string str() const;  // tensor<2x3xf32>
  bool operator==(const TensorType&) const = default;
};

struct Value {
  std::string name;  // SSA name: %argN, %vN or %vN#k
  TensorType type;
  const Dims& dims() const { return type.dims; }
  ElementType element() const { return type.element; }
  int64_t rank() const { return static_cast<int64_t>(type.dims.size()); }
};

// Reduction bodies and comparison directions understood by the builder.
enum class Reducer { Add, Mul, Max, Min, And, Or };
enum class Compare { EQ, NE, LT, LE, GT, GE };

// A region's body (a reducer, a sort comparator, a scatter's update): given
// its block arguments, emits its ops through the same builder and returns
// what stablehlo.return yields.
class Builder;
using RegionBody = std::function<std::vector<Value>(Builder&, const std::vector<Value>&)>;
struct Region {
  std::string text;  // "{ ^bb0(...): ... stablehlo.return }", ready to attach to an op
};

// Where an emitted op came from: the ATen op and the user's line.
struct Location {
  std::string op;    // "aten::add.Tensor"
  std::string file;  // "" when unknown
  int line = 0;
  // The op's index in a fused graph (-1: none). Several ops often share a
  // line; this tells them apart in an error (graph_op_location_mark).
  int64_t graph_op = -1;
};
// What a verifier error's text holds for an op of `Location::graph_op` k:
// its location is a call site, the user's line called from "torch_pjrt graph op k".
std::string graph_op_location_mark(int64_t k);

// The module text's tail that holds the ops' locations: after this marker,
// one "#opN = loc(...)" alias per location. Ops refer to their alias by
// number only, so the text before the marker is the same program whatever
// lines recorded it: the compile cache keys on that part alone.
inline constexpr std::string_view kLocationsMarker = "// torch_pjrt op locations\n";
// {program without its locations, the locations' tail} ("" if none).
std::pair<std::string_view, std::string_view> split_locations(std::string_view module_text);

class Builder {
 public:
  Value parameter(TensorType type);

  // The location of every op emitted from now on (and of the ops inside
  // their regions). Each call takes the next alias number, whatever the
  // location says, so a program's body does not depend on its lines.
  void set_location(Location location);

  // A region with block arguments of `arg_types` (scalars, for the ops here)
  // whose body `body` emits; fresh SSA names come from this builder. The
  // region's ops do not add to compile_cost (XLA inlines a scalar body).
  Region region(const std::vector<TensorType>& arg_types, const RegionBody& body);

  // Scalars and constants (broadcast to `dims`).
  Value constant(double value, ElementType type, const Dims& dims = {});
  Value constant_int(int64_t value, ElementType type, const Dims& dims = {});
  Value constant_bool(bool value, const Dims& dims = {});
  Value iota(TensorType type, int64_t dimension);

  // Elementwise; operands must already share shape and element type.
  Value unary(std::string_view op, Value x);  // op without the "stablehlo." prefix
  // "maximum" and "minimum" go through max()/min() below, so every lowering
  // gets PyTorch's NaN propagation.
  Value binary(std::string_view op, Value a, Value b);
  Value compare(Value a, Value b, Compare direction);
  Value select(Value pred, Value on_true, Value on_false);
  // NaN-propagating max/min (torch.maximum): a NaN operand is the result. The
  // plugin's own maximum/minimum may drop NaN. Reductions and windows with
  // Reducer::Max/Min propagate NaN the same way.
  Value max(Value a, Value b);
  Value min(Value a, Value b);
  Value clamp(Value lo, Value x, Value hi);  // min(max(x, lo), hi): NaN in any operand is the result
  // Complex numbers: parts (real() of a real value is itself, imag() zeros),
  // assembly from two equal real types, and the conjugate.
  Value real(Value x);
  Value imag(Value x);
  Value complex(Value re, Value im);
  Value conj(Value x);
  // Complex to real keeps the real part, as PyTorch's casts do; to bool it is
  // x != 0.
  Value convert(Value x, ElementType to);
  Value bitcast_convert(Value x, TensorType to);

  // Shape.
  Value broadcast_in_dim(Value x, const Dims& dims, const Dims& broadcast_dimensions);
  Value reshape(Value x, const Dims& dims);
  Value transpose(Value x, const Dims& permutation);
  Value slice(Value x, const Dims& start, const Dims& limit, const Dims& strides);
  Value concatenate(const std::vector<Value>& xs, int64_t dimension);
  Value pad(Value x, Value pad_value, const Dims& low, const Dims& high, const Dims& interior);
  Value reverse(Value x, const Dims& dims);
  Value dynamic_update_slice(Value operand, Value update, const std::vector<Value>& start_indices);
  Value dynamic_slice(Value operand, const std::vector<Value>& start_indices, const Dims& sizes);

  // Reductions and windows. `init` must be a 0-d value of x's element type.
  Value reduce(Value x, Value init, const Dims& dims, Reducer reducer);
  // Variadic reduce over `dims` with a reducer of your own: `body` gets
  // (accumulators..., elements...) as scalars and returns the new accumulators.
  std::vector<Value> reduce(const std::vector<Value>& xs, const std::vector<Value>& inits, const Dims& dims,
                            const RegionBody& body);
  // Variadic reduce for argmax/argmin: returns {values, indices}.
  std::vector<Value> reduce_arg(Value x, Value indices, int64_t dim, bool is_max);
  // Windowed max with its index (NaN wins, ties go to the lower index); no padding.
  std::vector<Value> reduce_window_max_arg(Value x, Value indices, Value init, Value init_index, const Dims& window,
                                           const Dims& strides, const Dims& dilations);
  Value reduce_window(Value x, Value init, Reducer reducer, const Dims& window, const Dims& strides,
                      const Dims& padding_low, const Dims& padding_high, const Dims& base_dilations = {},
                      const Dims& window_dilations = {});
  Value select_and_scatter(Value operand, Value source, Value init, const Dims& window, const Dims& strides,
                           const Dims& padding_low, const Dims& padding_high);

  // Linear algebra. Float32 dots and convolutions compute at `precision`
  // (XLA's DEFAULT lets a GPU use TF32 or bf16 passes; HIGHEST is full
  // float32, what PyTorch's default float32 matmul precision "highest" means).
  enum class Precision { Default, High, Highest };
  void set_float32_precision(Precision precision) { float32_precision_ = precision; }
  Value dot_general(Value a, Value b, const Dims& lhs_batch, const Dims& rhs_batch, const Dims& lhs_contract,
                    const Dims& rhs_contract, ElementType result);
  // Layout: lhs [N, C, spatial...], rhs [O, I, spatial...], out [N, C, spatial...].
  // The result has lhs's element type unless `result` says otherwise (f32 for
  // f16/bf16 inputs: accumulate wide).
  Value convolution(Value lhs, Value rhs, const Dims& out_dims, const Dims& strides, const Dims& padding_low,
                    const Dims& padding_high, const Dims& lhs_dilation, const Dims& rhs_dilation,
                    int64_t feature_group_count, int64_t batch_group_count = 1,
                    std::optional<ElementType> result = std::nullopt);

  // Indexing (generic dimension numbers, as in the StableHLO spec).
  struct GatherDims {
    Dims offset_dims, collapsed_slice_dims, operand_batching_dims, start_indices_batching_dims, start_index_map;
    int64_t index_vector_dim;
  };
  Value gather(Value operand, Value indices, const GatherDims& dn, const Dims& slice_sizes, const Dims& out_dims);
  struct ScatterDims {
    Dims update_window_dims, inserted_window_dims, input_batching_dims, scatter_indices_batching_dims,
        scatter_dims_to_operand_dims;
    int64_t index_vector_dim;
  };
  // Each update is combined with the value it lands on (Add accumulates, or
  // Mul, Max, Min, ...); std::nullopt overwrites it.
  Value scatter(Value operand, Value indices, Value updates, const ScatterDims& dn,
                std::optional<Reducer> combine);

  // stablehlo.fft over the last lengths.size() (1 to 3) dims. `type` is FFT,
  // IFFT (scaled by 1/n), RFFT (real in, last dim n/2+1 out) or IRFFT
  // (the inverse of RFFT, scaled by 1/n).
  Value fft(Value x, std::string_view type, const Dims& lengths);

  // Sorts along `dim`; the first operand is the key. Returns all operands sorted.
  std::vector<Value> sort(const std::vector<Value>& operands, int64_t dim, bool descending, bool stable = true);

  // Random bits: returns {new_state, bits}. State is ui64[2] (Threefry key/counter).
  std::vector<Value> rng_bit_generator(Value state, TensorType bits_type);

  // Collectives across the replicas of a program compiled for N replicas
  // (cross-replica mode: no channel handle, ids are replica ids). `groups`
  // partitions the replicas; each group reduces/gathers among itself.
  using ReplicaGroups = std::vector<Dims>;
  Value all_reduce(Value x, Reducer reducer, const ReplicaGroups& groups);
  Value all_gather(Value x, int64_t dim, const ReplicaGroups& groups);      // dim grows by the group size
  Value reduce_scatter(Value x, int64_t dim, Reducer reducer, const ReplicaGroups& groups);  // dim shrinks by it
  // Splits `dim` into group-size chunks, sends chunk j to the group's j-th replica, concatenates the received chunks
  // along `dim`.
  Value all_to_all(Value x, int64_t dim, const ReplicaGroups& groups);
  Value replica_id();  // this replica's index (ui32 scalar)
  // Each (source, target) replica pair: target receives source's x; a replica that is no target gets zeros.
  Value collective_permute(Value x, const std::vector<std::pair<int64_t, int64_t>>& source_target_pairs);

  // A call to a function the plugin registered under `target` (custom kernels).
  Value custom_call(const std::string& target, const std::vector<Value>& operands, TensorType result);

  // A call to a function defined outside the builder (a JAX kernel's module):
  // `definitions` is the text of one or more func.func ops in generic form,
  // every symbol already unique to them (the caller renames), added to the
  // module once per `symbol`. Returns the callee's results.
  std::vector<Value> call(const std::string& symbol, const std::string& definitions, const std::vector<Value>& operands,
                          const std::vector<TensorType>& results);

  // Closes @main returning `results`; returns the module text.
  // `aliases` maps a parameter index to the result that may reuse its buffer
  // (a donated input: an in-place update that does not double memory).
  std::string finish(const std::vector<Value>& results, const std::map<int, int>& aliases = {}) const;
  const std::vector<TensorType>& parameters() const { return params_; }

  // What XLA will spend compiling the instructions emitted so far, in units
  // of one cheap instruction (fused graphs cut on it; see compile_weight).
  size_t compile_cost() const { return compile_cost_; }

 private:
  Value emit(std::string_view op, const std::vector<Value>& operands, const std::string& attributes,
             TensorType result, const std::vector<Region>& regions = {});
  Region arg_region(ElementType value, ElementType index, bool is_max, bool last_nan = false);
  std::vector<Value> emit_multi(std::string_view op, const std::vector<Value>& operands,
                                const std::string& attributes, const std::vector<TensorType>& results,
                                const std::vector<Region>& regions = {});
  // `propagate_nan` false: the bare op (the CPU plugin's collectives accept
  // only single-op reduction regions).
  Region reducer_region(Reducer reducer, ElementType type, bool propagate_nan = true);
  std::string fresh_name() { return "%v" + std::to_string(next_id_++); }
  // A collective reduction (all_reduce/reduce_scatter via `reduce_op`) whose float
  // Max/Min still propagates NaN: a NaN anywhere in the group is the result.
  Value nan_propagating_collective(Value x, Reducer reducer, const std::function<Value(Value, Reducer)>& reduce_op);
  Value nan_propagating(const char* op, Value a, Value b);
  // The precision_config attribute for a dot or convolution of `operand`s type ("" for none).
  std::string precision_attr(const Value& operand) const;
  int next_id_ = 0;
  size_t compile_cost_ = 0;
  Precision float32_precision_ = Precision::Highest;
  std::vector<TensorType> params_;
  std::string body_;
  std::string indent_ = "    ";  // deeper inside a region
  std::string location_;        // " loc(#opN)" appended to each op ("" before set_location)
  std::vector<std::string> locations_;  // per alias number: its loc(...)
  std::map<std::string, std::string> functions_;  // symbol -> definitions, emitted after @main
};

std::string dims_attr(const Dims& dims);  // array<i64: 1, 2>

}  // namespace torch_pjrt::hlo
