#include "hlo/builder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <stdexcept>

#include "pjrt/error.h"

namespace torch_pjrt::hlo {
namespace {

std::string join(const Dims& dims, const char* sep) {
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += sep;
    out += std::to_string(dims[i]);
  }
  return out;
}

std::string list(const Dims& dims) { return "[" + join(dims, ", ") + "]"; }

// Bit pattern of `v` in a floating type, so constants are exact in text form.
uint64_t float_bits(double v, ElementType t) {
  if (t == ElementType::F64) {
    uint64_t b;
    std::memcpy(&b, &v, 8);
    return b;
  }
  float f = static_cast<float>(v);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (t == ElementType::F32) return b;
  if (t == ElementType::BF16) {
    if (std::isnan(f)) return 0x7FC0;
    uint32_t rounding = 0x7FFF + ((b >> 16) & 1);  // round to nearest even
    return (b + rounding) >> 16;
  }
  // F16 from float, round to nearest even.
  uint32_t sign = (b >> 16) & 0x8000;
  if (std::isnan(f)) return sign | 0x7E00;
  float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7C00;
  if (a < 6.103515625e-05f) {  // subnormal half
    uint32_t m = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));  // a / 2^-24
    return sign | m;
  }
  uint32_t exp = ((b >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = b & 0x7FFFFF;
  uint32_t half = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
  return sign | half;
}

std::string float_literal(double v, ElementType t) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llX", static_cast<unsigned long long>(float_bits(v, t)));
  return text;
}

std::string padding_attr(const Dims& low, const Dims& high) {
  std::string s = "dense<[";
  for (size_t i = 0; i < low.size(); ++i) {
    if (i) s += ", ";
    s += "[" + std::to_string(low[i]) + ", " + std::to_string(high[i]) + "]";
  }
  s += "]> : tensor<" + std::to_string(low.size()) + "x2xi64>";
  return s;
}

const char* direction_name(Compare c) {
  switch (c) {
    case Compare::EQ: return "EQ";
    case Compare::NE: return "NE";
    case Compare::LT: return "LT";
    case Compare::LE: return "LE";
    case Compare::GT: return "GT";
    case Compare::GE: return "GE";
  }
  return "EQ";
}

std::string compare_attr(Compare c) {
  return std::string("{comparison_direction = #stablehlo<comparison_direction ") + direction_name(c) + ">}";
}

Dims ones(size_t n) { return Dims(n, 1); }

}  // namespace

int64_t TensorType::element_count() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string TensorType::str() const {
  std::string s = "tensor<";
  for (int64_t d : dims) s += std::to_string(d) + "x";
  s += mlir_name(element);
  return s + ">";
}

std::string dims_attr(const Dims& dims) {
  return dims.empty() ? "array<i64>" : "array<i64: " + join(dims, ", ") + ">";
}

namespace {
// An MLIR string literal: quotes, backslashes and unprintable bytes escaped as \XX.
std::string mlir_string(std::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\' || c < 0x20 || c >= 0x7F) {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "\\%02X", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}
}  // namespace

std::pair<std::string_view, std::string_view> split_locations(std::string_view module_text) {
  size_t at = module_text.rfind(kLocationsMarker);
  if (at == std::string_view::npos) return {module_text, {}};
  return {module_text.substr(0, at), module_text.substr(at)};
}

std::string graph_op_location_mark(int64_t k) { return "torch_pjrt graph op " + std::to_string(k) + ":0:0: note"; }

void Builder::set_location(Location location) {
  // A name location ("aten::add.Tensor") around a file one; XLA turns them
  // into the HLO instructions' metadata (op_name, source_file, source_line).
  std::string file;
  if (!location.file.empty())
    file = mlir_string(location.file) + ":" + std::to_string(location.line) + ":0";
  std::string text;
  if (location.op.empty()) text = file.empty() ? "unknown" : file;
  else text = mlir_string(location.op) + (file.empty() ? "" : "(" + file + ")");
  // The verifier reports "file:line:0: error" and, for a call site, a note
  // "torch_pjrt graph op k:0:0: note: called from": the op itself.
  if (location.graph_op >= 0)
    text = "callsite(" + text + " at \"torch_pjrt graph op " + std::to_string(location.graph_op) + "\":0:0)";
  location_ = " loc(#op" + std::to_string(locations_.size()) + ")";
  locations_.push_back("loc(" + text + ")");
}

Region Builder::region(const std::vector<TensorType>& arg_types, const RegionBody& body) {
  std::vector<Value> args;
  std::string header = "^bb0(";
  for (size_t i = 0; i < arg_types.size(); ++i) {
    args.push_back(Value{fresh_name(), arg_types[i]});
    header += (i ? ", " : "") + args.back().name + ": " + arg_types[i].str();
  }
  header += "):\n";
  // The body's ops go to a text of their own; the enclosing op's text (and
  // its cost) are restored however the body ends.
  struct Restore {
    Builder& b;
    std::string body, indent;
    size_t cost;
    ~Restore() {
      b.body_ = std::move(body);
      b.indent_ = std::move(indent);
      b.compile_cost_ = cost;
    }
  } restore{*this, std::exchange(body_, std::string()), indent_, compile_cost_};
  indent_ += "    ";
  std::vector<Value> results = body(*this, args);
  std::string names, types;
  for (size_t i = 0; i < results.size(); ++i) {
    names += (i ? ", " : "") + results[i].name;
    types += (i ? ", " : "") + results[i].type.str();
  }
  body_ += indent_ + "\"stablehlo.return\"(" + names + ") : (" + types + ") -> ()" + location_ + "\n";
  return Region{"{\n" + restore.indent + "  " + header + body_ + restore.indent + "}"};
}

Value Builder::parameter(TensorType type) {
  Value v{"%arg" + std::to_string(params_.size()), type};
  params_.push_back(std::move(type));
  return v;
}

Value Builder::emit(std::string_view op, const std::vector<Value>& operands, const std::string& attributes,
                    TensorType result, const std::vector<Region>& regions) {
  return emit_multi(op, operands, attributes, {std::move(result)}, regions)[0];
}

namespace {
// XLA:CPU's compile time per instruction, relative to a cheap one (an add, a
// slice, a sine), measured on fused graphs of hundreds of copies of one op:
// transcendental ops expand into polynomial code (exp, log, tanh, erf: ~4x),
// CHLO ops into whole algorithms, and on complex numbers both expand again
// (complex sqrt ~15x, acos/asinh ~25x).
size_t compile_weight(std::string_view op, const std::vector<TensorType>& results,
                      const std::vector<Value>& operands) {
  static constexpr std::string_view kExpanding[] = {"exponential", "exponential_minus_one", "log", "log_plus_one",
                                                    "tanh", "logistic", "power", "sqrt", "rsqrt", "cbrt", "atan2"};
  bool expands = op.rfind("chlo.", 0) == 0;
  for (std::string_view name : kExpanding) expands = expands || op == name;
  if (!expands) return 1;
  bool complex = false;
  for (const TensorType& t : results) complex = complex || is_complex(t.element);
  for (const Value& v : operands) complex = complex || is_complex(v.element());
  return complex ? 64 : 4;
}
}  // namespace

std::vector<Value> Builder::emit_multi(std::string_view op, const std::vector<Value>& operands,
                                       const std::string& attributes, const std::vector<TensorType>& results,
                                       const std::vector<Region>& regions) {
  compile_cost_ += compile_weight(op, results, operands);
  std::string name = fresh_name();
  std::string line = indent_ + name;
  if (results.size() > 1) line += ":" + std::to_string(results.size());
  // Bare names are StableHLO ops; "chlo.erf" and friends are legalized by the plugin.
  line += op.find('.') == std::string_view::npos ? " = \"stablehlo." : " = \"";
  line += op;
  line += "\"(";
  std::string operand_types;
  for (size_t i = 0; i < operands.size(); ++i) {
    if (i) {
      line += ", ";
      operand_types += ", ";
    }
    line += operands[i].name;
    operand_types += operands[i].type.str();
  }
  line += ")";
  if (!regions.empty()) {
    line += " (";
    for (size_t i = 0; i < regions.size(); ++i) line += (i ? ", " : "") + regions[i].text;
    line += ")";
  }
  if (!attributes.empty()) line += " " + attributes;
  line += " : (" + operand_types + ") -> ";
  if (results.size() == 1) {
    line += results[0].str();
  } else {
    line += "(";
    for (size_t i = 0; i < results.size(); ++i) line += (i ? ", " : "") + results[i].str();
    line += ")";
  }
  body_ += line + location_ + "\n";
  std::vector<Value> values;
  if (results.size() == 1) return {Value{name, results[0]}};
  for (size_t k = 0; k < results.size(); ++k) values.push_back(Value{name + "#" + std::to_string(k), results[k]});
  return values;
}

Value Builder::constant(double value, ElementType type, const Dims& dims) {
  if (is_complex(type)) {  // (value, 0) from two real constants: no complex literal syntax to get wrong
    ElementType part = real_part_type(type);
    return complex(constant(value, part, dims), constant(0, part, dims));
  }
  if (!is_float(type)) {
    if (type == ElementType::Pred) return constant_bool(value != 0, dims);
    // Saturate to the type's range (+-inf: its largest and smallest value);
    // an out-of-range literal would be rejected by the parser.
    int bits = static_cast<int>(byte_size(type)) * 8;
    double lo = is_unsigned(type) ? 0 : -std::ldexp(1.0, bits - 1), hi = std::ldexp(1.0, bits - (is_unsigned(type) ? 0 : 1));
    if (std::isnan(value)) value = 0;
    if (value < lo) value = lo;
    if (value >= hi) {
      if (type == ElementType::U64) return constant_int(-1, type, dims);  // all ones
      if (bits == 64) return constant_int(INT64_MAX, type, dims);
      value = hi - 1;
    }
    if (type == ElementType::U64 && value >= std::ldexp(1.0, 63))
      return constant_int(static_cast<int64_t>(static_cast<uint64_t>(value)), type, dims);
    return constant_int(static_cast<int64_t>(value), type, dims);
  }
  TensorType t{type, dims};
  return emit("constant", {}, "{value = dense<" + float_literal(value, type) + "> : " + t.str() + "}", t);
}

Value Builder::constant_int(int64_t value, ElementType type, const Dims& dims) {
  if (is_float(type) || is_complex(type)) return constant(static_cast<double>(value), type, dims);
  if (type == ElementType::Pred) return constant_bool(value != 0, dims);
  TensorType t{type, dims};
  std::string literal = is_unsigned(type) ? std::to_string(static_cast<uint64_t>(value)) : std::to_string(value);
  return emit("constant", {}, "{value = dense<" + literal + "> : " + t.str() + "}", t);
}

Value Builder::constant_bool(bool value, const Dims& dims) {
  TensorType t{ElementType::Pred, dims};
  return emit("constant", {}, std::string("{value = dense<") + (value ? "true" : "false") + "> : " + t.str() + "}", t);
}

Value Builder::iota(TensorType type, int64_t dimension) {
  return emit("iota", {}, "{iota_dimension = " + std::to_string(dimension) + " : i64}", type);
}

Value Builder::unary(std::string_view op, Value x) {
  // abs of a complex value is its real magnitude.
  if (op == "abs" && is_complex(x.element())) return emit(op, {x}, "", TensorType{real_part_type(x.element()), x.dims()});
  return emit(op, {x}, "", x.type);
}

Value Builder::real(Value x) {
  if (!is_complex(x.element())) return x;
  return emit("real", {x}, "", TensorType{real_part_type(x.element()), x.dims()});
}
Value Builder::imag(Value x) {
  if (!is_complex(x.element())) return constant(0, x.element(), x.dims());
  return emit("imag", {x}, "", TensorType{real_part_type(x.element()), x.dims()});
}
Value Builder::complex(Value re, Value im) {
  PJRT_CHECK(re.type == im.type && is_float(re.element()), "internal: complex parts differ: ", re.type.str(), " vs ",
             im.type.str());
  return emit("complex", {re, im}, "", TensorType{complex_type_of(re.element()), re.dims()});
}
Value Builder::conj(Value x) {
  if (!is_complex(x.element())) return x;
  return complex(real(x), emit("negate", {imag(x)}, "", TensorType{real_part_type(x.element()), x.dims()}));
}

Value Builder::binary(std::string_view op, Value a, Value b) {
  PJRT_CHECK(a.type == b.type, "internal: stablehlo.", op, " operands differ: ", a.type.str(), " vs ", b.type.str());
  if (op == "maximum") return max(a, b);
  if (op == "minimum") return min(a, b);
  return emit(op, {a, b}, "", a.type);
}

// Where either operand is NaN, that operand; elsewhere the plain op.
Value Builder::nan_propagating(const char* op, Value a, Value b) {
  PJRT_CHECK(a.type == b.type, "internal: stablehlo.", op, " operands differ: ", a.type.str(), " vs ", b.type.str());
  Value r = emit(op, {a, b}, "", a.type);
  if (!is_float(a.element())) return r;
  r = select(compare(b, b, Compare::NE), b, r);
  return select(compare(a, a, Compare::NE), a, r);
}
Value Builder::max(Value a, Value b) {
  return a.element() == ElementType::Pred ? emit("or", {a, b}, "", a.type) : nan_propagating("maximum", a, b);
}
Value Builder::min(Value a, Value b) {
  return a.element() == ElementType::Pred ? emit("and", {a, b}, "", a.type) : nan_propagating("minimum", a, b);
}

Value Builder::compare(Value a, Value b, Compare direction) {
  PJRT_CHECK(a.type == b.type, "internal: compare operands differ: ", a.type.str(), " vs ", b.type.str());
  return emit("compare", {a, b}, compare_attr(direction), TensorType{ElementType::Pred, a.dims()});
}

Value Builder::select(Value pred, Value on_true, Value on_false) {
  return emit("select", {pred, on_true, on_false}, "", on_true.type);
}

Value Builder::clamp(Value lo, Value x, Value hi) {
  if (!is_float(x.element())) return emit("clamp", {lo, x, hi}, "", x.type);
  return min(max(x, lo), hi);
}

Value Builder::convert(Value x, ElementType to) {
  if (x.element() == to) return x;
  // XLA converts complex to real only through real(); between complex types
  // and from real to complex part by part (the imaginary part of a real is 0).
  if (is_complex(x.element()) && to == ElementType::Pred)  // truthiness: either part nonzero
    return compare(x, constant(0, x.element(), x.dims()), Compare::NE);
  if (is_complex(x.element()) && !is_complex(to)) return convert(real(x), to);
  if (is_complex(to)) {
    ElementType part = real_part_type(to);
    return complex(convert(real(x), part), is_complex(x.element()) ? convert(imag(x), part) : constant(0, part, x.dims()));
  }
  return emit("convert", {x}, "", TensorType{to, x.dims()});
}

Value Builder::fft(Value x, std::string_view type, const Dims& lengths) {
  PJRT_CHECK(!lengths.empty() && lengths.size() <= 3 && static_cast<int64_t>(lengths.size()) <= x.rank(),
             "internal: fft over ", lengths.size(), " dims of ", x.type.str());
  TensorType result = x.type;
  if (type == "RFFT") {
    result.element = complex_type_of(x.element());
    result.dims.back() = lengths.back() / 2 + 1;
  } else if (type == "IRFFT") {
    result.element = real_part_type(x.element());
    result.dims.back() = lengths.back();
  }
  std::string attrs = "{fft_type = #stablehlo<fft_type " + std::string(type) + ">, fft_length = " + dims_attr(lengths) + "}";
  return emit("fft", {x}, attrs, result);
}

Value Builder::bitcast_convert(Value x, TensorType to) { return emit("bitcast_convert", {x}, "", to); }

Value Builder::broadcast_in_dim(Value x, const Dims& dims, const Dims& broadcast_dimensions) {
  if (x.dims() == dims) return x;
  return emit("broadcast_in_dim", {x}, "{broadcast_dimensions = " + dims_attr(broadcast_dimensions) + "}",
              TensorType{x.element(), dims});
}

Value Builder::custom_call(const std::string& target, const std::vector<Value>& operands, TensorType result) {
  return emit("custom_call", operands, "{call_target_name = \"" + target + "\"}", std::move(result));
}

std::vector<Value> Builder::call(const std::string& symbol, const std::string& definitions,
                                 const std::vector<Value>& operands, const std::vector<TensorType>& results) {
  PJRT_CHECK(!results.empty(), "internal: a called function must return a value: @", symbol);
  functions_.emplace(symbol, definitions);
  return emit_multi("func.call", operands, "{callee = @" + symbol + "}", results);
}

Value Builder::reshape(Value x, const Dims& dims) {
  if (x.dims() == dims) return x;
  return emit("reshape", {x}, "", TensorType{x.element(), dims});
}

Value Builder::transpose(Value x, const Dims& permutation) {
  PJRT_CHECK(static_cast<int64_t>(permutation.size()) == x.rank(), "internal: transpose rank mismatch for ", x.type.str());
  for (int64_t d : permutation) PJRT_CHECK(d >= 0 && d < x.rank(), "internal: transpose dim ", d, " of ", x.type.str());
  bool identity = true;
  Dims out;
  for (size_t i = 0; i < permutation.size(); ++i) {
    identity &= permutation[i] == static_cast<int64_t>(i);
    out.push_back(x.dims()[permutation[i]]);
  }
  if (identity) return x;
  return emit("transpose", {x}, "{permutation = " + dims_attr(permutation) + "}", TensorType{x.element(), out});
}

Value Builder::slice(Value x, const Dims& start, const Dims& limit, const Dims& strides) {
  Dims out;
  bool identity = true;
  for (size_t i = 0; i < start.size(); ++i) {
    out.push_back(std::max<int64_t>(0, (limit[i] - start[i] + strides[i] - 1) / strides[i]));
    identity &= start[i] == 0 && limit[i] == x.dims()[i] && strides[i] == 1;
  }
  if (identity) return x;
  return emit("slice", {x},
              "{start_indices = " + dims_attr(start) + ", limit_indices = " + dims_attr(limit) +
                  ", strides = " + dims_attr(strides) + "}",
              TensorType{x.element(), out});
}

Value Builder::concatenate(const std::vector<Value>& xs, int64_t dimension) {
  if (xs.size() == 1) return xs[0];
  PJRT_CHECK(dimension >= 0 && dimension < xs[0].rank(), "internal: concatenate along dim ", dimension);
  Dims out = xs[0].dims();
  out[dimension] = 0;
  for (const Value& x : xs) out[dimension] += x.dims()[dimension];
  return emit("concatenate", xs, "{dimension = " + std::to_string(dimension) + " : i64}",
              TensorType{xs[0].element(), out});
}

Value Builder::pad(Value x, Value pad_value, const Dims& low, const Dims& high, const Dims& interior) {
  Dims out;
  for (size_t i = 0; i < low.size(); ++i) {
    int64_t d = x.dims()[i];
    out.push_back(low[i] + high[i] + d + std::max<int64_t>(0, d - 1) * interior[i]);
  }
  return emit("pad", {x, pad_value},
              "{edge_padding_low = " + dims_attr(low) + ", edge_padding_high = " + dims_attr(high) +
                  ", interior_padding = " + dims_attr(interior) + "}",
              TensorType{x.element(), out});
}

Value Builder::reverse(Value x, const Dims& dims) {
  if (dims.empty()) return x;
  return emit("reverse", {x}, "{dimensions = " + dims_attr(dims) + "}", x.type);
}

Value Builder::dynamic_update_slice(Value operand, Value update, const std::vector<Value>& start_indices) {
  std::vector<Value> operands{operand, update};
  operands.insert(operands.end(), start_indices.begin(), start_indices.end());
  return emit("dynamic_update_slice", operands, "", operand.type);
}

Value Builder::dynamic_slice(Value operand, const std::vector<Value>& start_indices, const Dims& sizes) {
  std::vector<Value> operands{operand};
  operands.insert(operands.end(), start_indices.begin(), start_indices.end());
  return emit("dynamic_slice", operands, "{slice_sizes = " + dims_attr(sizes) + "}",
              TensorType{operand.element(), sizes});
}

Region Builder::reducer_region(Reducer reducer, ElementType type, bool propagate_nan) {
  const char* op = "add";
  switch (reducer) {
    case Reducer::Add: op = type == ElementType::Pred ? "or" : "add"; break;
    case Reducer::Mul: op = type == ElementType::Pred ? "and" : "multiply"; break;
    case Reducer::Max: op = type == ElementType::Pred ? "or" : "maximum"; break;
    case Reducer::Min: op = type == ElementType::Pred ? "and" : "minimum"; break;
    case Reducer::And: op = "and"; break;
    case Reducer::Or: op = "or"; break;
  }
  TensorType scalar{type, {}};
  // NaN propagates, as in max(): a NaN operand is the result.
  bool nan = propagate_nan && (reducer == Reducer::Max || reducer == Reducer::Min) && type != ElementType::Pred;
  return region({scalar, scalar}, [&](Builder& b, const std::vector<Value>& x) -> std::vector<Value> {
    return {nan ? b.nan_propagating(op, x[0], x[1]) : b.emit(op, {x[0], x[1]}, "", scalar)};
  });
}

Value Builder::reduce(Value x, Value init, const Dims& dims, Reducer reducer) {
  for (int64_t d : dims) PJRT_CHECK(d >= 0 && d < x.rank(), "internal: reduce over dim ", d, " of ", x.type.str());
  Dims out;
  for (int64_t i = 0; i < x.rank(); ++i) {
    bool reduced = false;
    for (int64_t d : dims) reduced |= d == i;
    if (!reduced) out.push_back(x.dims()[i]);
  }
  return emit("reduce", {x, init}, "{dimensions = " + dims_attr(dims) + "}", TensorType{x.element(), out},
              {reducer_region(reducer, x.element())});
}

std::vector<Value> Builder::reduce(const std::vector<Value>& xs, const std::vector<Value>& inits, const Dims& dims,
                                   const RegionBody& body) {
  PJRT_CHECK(!xs.empty() && xs.size() == inits.size(), "internal: reduce of ", xs.size(), " operands with ",
             inits.size(), " initial values");
  std::vector<TensorType> args, results;
  for (int pass = 0; pass < 2; ++pass)
    for (const Value& x : xs) args.push_back(TensorType{x.element(), {}});
  for (const Value& x : xs) {
    Dims out;
    for (int64_t i = 0; i < x.rank(); ++i)
      if (std::find(dims.begin(), dims.end(), i) == dims.end()) out.push_back(x.dims()[i]);
    results.push_back(TensorType{x.element(), out});
  }
  std::vector<Value> operands = xs;
  operands.insert(operands.end(), inits.begin(), inits.end());
  return emit_multi("reduce", operands, "{dimensions = " + dims_attr(dims) + "}", results, {region(args, body)});
}

// The (value, index) reducer region of argmax/argmin and max pooling.
Region Builder::arg_region(ElementType value, ElementType index, bool is_max, bool last_nan) {
  TensorType vt{value, {}}, it{index, {}};
  return region({vt, it, vt, it}, [&](Builder& r, const std::vector<Value>& x) -> std::vector<Value> {
    const Value &a = x[0], &ai = x[1], &b = x[2], &bi = x[3];
    // PyTorch semantics: NaN wins, equal values go to the lower index; among
    // NaNs the lower index, or the higher one with `last_nan` (max pooling).
    Value better = r.compare(a, b, is_max ? Compare::GT : Compare::LT);
    Value a_nan = r.compare(a, a, Compare::NE), b_nan = r.compare(b, b, Compare::NE);
    Value nan_wins = r.binary("and", a_nan, r.unary("not", b_nan));
    Value eq = r.compare(a, b, Compare::EQ);
    Value both_nan = r.binary("and", a_nan, b_nan);
    Value lower = r.compare(ai, bi, Compare::LT);
    Value nan_side = r.compare(ai, bi, last_nan ? Compare::GT : Compare::LT);
    Value pick = r.binary("or", r.binary("or", r.binary("or", better, nan_wins), r.binary("and", eq, lower)),
                          r.binary("and", both_nan, nan_side));
    return {r.select(pick, a, b), r.select(pick, ai, bi)};
  });
}

std::vector<Value> Builder::reduce_arg(Value x, Value indices, int64_t dim, bool is_max) {
  Dims out;
  for (int64_t d = 0; d < x.rank(); ++d)
    if (d != dim) out.push_back(x.dims()[d]);
  Value init_v;
  if (is_float(x.element())) {
    init_v = constant(is_max ? -INFINITY : INFINITY, x.element());
  } else {
    int bits = static_cast<int>(byte_size(x.element())) * 8;
    int64_t lo = is_unsigned(x.element()) ? 0 : (bits == 64 ? INT64_MIN : -(int64_t{1} << (bits - 1)));
    int64_t hi = is_unsigned(x.element()) ? (bits == 64 ? -1 : (int64_t{1} << bits) - 1)
                                          : (bits == 64 ? INT64_MAX : (int64_t{1} << (bits - 1)) - 1);
    init_v = x.element() == ElementType::Pred ? constant_bool(!is_max) : constant_int(is_max ? lo : hi, x.element());
  }
  Value init_i = constant_int(0, indices.element());
  return emit_multi("reduce", {x, indices, init_v, init_i}, "{dimensions = " + dims_attr({dim}) + "}",
                    {TensorType{x.element(), out}, TensorType{indices.element(), out}},
                    {arg_region(x.element(), indices.element(), is_max)});
}

Value Builder::reduce_window(Value x, Value init, Reducer reducer, const Dims& window, const Dims& strides,
                             const Dims& padding_low, const Dims& padding_high, const Dims& base_dilations,
                             const Dims& window_dilations) {
  size_t rank = window.size();
  Dims bd = base_dilations.empty() ? ones(rank) : base_dilations;
  Dims wd = window_dilations.empty() ? ones(rank) : window_dilations;
  Dims out;
  for (size_t i = 0; i < rank; ++i) {
    int64_t in = (x.dims()[i] - 1) * bd[i] + 1 + padding_low[i] + padding_high[i];
    int64_t win = (window[i] - 1) * wd[i] + 1;
    out.push_back(in < win ? 0 : (in - win) / strides[i] + 1);
  }
  return emit("reduce_window", {x, init},
              "{window_dimensions = " + dims_attr(window) + ", window_strides = " + dims_attr(strides) +
                  ", base_dilations = " + dims_attr(bd) + ", window_dilations = " + dims_attr(wd) +
                  ", padding = " + padding_attr(padding_low, padding_high) + "}",
              TensorType{x.element(), out}, {reducer_region(reducer, x.element())});
}

std::vector<Value> Builder::reduce_window_max_arg(Value x, Value indices, Value init, Value init_index,
                                                  const Dims& window, const Dims& strides, const Dims& dilations) {
  Dims out;
  for (size_t i = 0; i < window.size(); ++i) {
    int64_t in = x.dims()[i], win = (window[i] - 1) * dilations[i] + 1;
    out.push_back(in < win ? 0 : (in - win) / strides[i] + 1);
  }
  return emit_multi("reduce_window", {x, indices, init, init_index},
                    "{window_dimensions = " + dims_attr(window) + ", window_strides = " + dims_attr(strides) +
                        ", window_dilations = " + dims_attr(dilations) + "}",
                    {TensorType{x.element(), out}, TensorType{indices.element(), out}},
                    {arg_region(x.element(), indices.element(), true, /*last_nan=*/true)});
}

Value Builder::select_and_scatter(Value operand, Value source, Value init, const Dims& window, const Dims& strides,
                                  const Dims& padding_low, const Dims& padding_high) {
  TensorType scalar{operand.element(), {}};
  Region select = region({scalar, scalar}, [](Builder& r, const std::vector<Value>& x) -> std::vector<Value> {
    return {r.compare(x[0], x[1], Compare::GE)};
  });
  Region scatter = reducer_region(Reducer::Add, operand.element());
  return emit("select_and_scatter", {operand, source, init},
              "{window_dimensions = " + dims_attr(window) + ", window_strides = " + dims_attr(strides) +
                  ", padding = " + padding_attr(padding_low, padding_high) + "}",
              operand.type, {select, scatter});
}

Value Builder::dot_general(Value a, Value b, const Dims& lhs_batch, const Dims& rhs_batch, const Dims& lhs_contract,
                           const Dims& rhs_contract, ElementType result) {
  Dims out;
  for (int64_t d : lhs_batch) out.push_back(a.dims()[d]);
  auto free_dims = [&](const Value& v, const Dims& batch, const Dims& contract) {
    for (int64_t i = 0; i < v.rank(); ++i) {
      bool used = false;
      for (int64_t d : batch) used |= d == i;
      for (int64_t d : contract) used |= d == i;
      if (!used) out.push_back(v.dims()[i]);
    }
  };
  free_dims(a, lhs_batch, lhs_contract);
  free_dims(b, rhs_batch, rhs_contract);
  std::string dn = "#stablehlo.dot<";
  std::vector<std::string> parts;
  if (!lhs_batch.empty()) parts.push_back("lhs_batching_dimensions = " + list(lhs_batch));
  if (!rhs_batch.empty()) parts.push_back("rhs_batching_dimensions = " + list(rhs_batch));
  parts.push_back("lhs_contracting_dimensions = " + list(lhs_contract));
  parts.push_back("rhs_contracting_dimensions = " + list(rhs_contract));
  for (size_t i = 0; i < parts.size(); ++i) dn += (i ? ", " : "") + parts[i];
  dn += ">";
  return emit("dot_general", {a, b}, "{dot_dimension_numbers = " + dn + precision_attr(a) + "}",
              TensorType{result, out});
}

std::string Builder::precision_attr(const Value& operand) const {
  if (operand.element() != ElementType::F32 && operand.element() != ElementType::C64) return "";
  const char* name = float32_precision_ == Precision::Highest ? "HIGHEST"
                     : float32_precision_ == Precision::High  ? "HIGH"
                                                              : "DEFAULT";
  return std::string(", precision_config = [#stablehlo<precision ") + name + ">, #stablehlo<precision " + name + ">]";
}

Value Builder::convolution(Value lhs, Value rhs, const Dims& out_dims, const Dims& strides, const Dims& padding_low,
                           const Dims& padding_high, const Dims& lhs_dilation, const Dims& rhs_dilation,
                           int64_t feature_group_count, int64_t batch_group_count,
                           std::optional<ElementType> result) {
  size_t spatial = strides.size();
  std::string sp;
  for (size_t i = 0; i < spatial; ++i) sp += ", " + std::to_string(i);
  std::string dn = "#stablehlo.conv<[b, f" + sp + "]x[o, i" + sp + "]->[b, f" + sp + "]>";
  return emit("convolution", {lhs, rhs},
              "{batch_group_count = " + std::to_string(batch_group_count) + " : i64, dimension_numbers = " + dn +
                  ", feature_group_count = " + std::to_string(feature_group_count) +
                  " : i64, lhs_dilation = " + dims_attr(lhs_dilation) + ", padding = " +
                  padding_attr(padding_low, padding_high) + ", rhs_dilation = " + dims_attr(rhs_dilation) +
                  ", window_strides = " + dims_attr(strides) + precision_attr(lhs) + "}",
              TensorType{result.value_or(lhs.element()), out_dims});
}

Value Builder::gather(Value operand, Value indices, const GatherDims& dn, const Dims& slice_sizes,
                      const Dims& out_dims) {
  std::string attr = "#stablehlo.gather<";
  std::vector<std::string> parts;
  if (!dn.offset_dims.empty()) parts.push_back("offset_dims = " + list(dn.offset_dims));
  if (!dn.collapsed_slice_dims.empty()) parts.push_back("collapsed_slice_dims = " + list(dn.collapsed_slice_dims));
  if (!dn.operand_batching_dims.empty()) parts.push_back("operand_batching_dims = " + list(dn.operand_batching_dims));
  if (!dn.start_indices_batching_dims.empty())
    parts.push_back("start_indices_batching_dims = " + list(dn.start_indices_batching_dims));
  parts.push_back("start_index_map = " + list(dn.start_index_map));
  parts.push_back("index_vector_dim = " + std::to_string(dn.index_vector_dim));
  for (size_t i = 0; i < parts.size(); ++i) attr += (i ? ", " : "") + parts[i];
  attr += ">";
  return emit("gather", {operand, indices},
              "{dimension_numbers = " + attr + ", indices_are_sorted = false, slice_sizes = " +
                  dims_attr(slice_sizes) + "}",
              TensorType{operand.element(), out_dims});
}

Value Builder::scatter(Value operand, Value indices, Value updates, const ScatterDims& dn,
                       std::optional<Reducer> combine) {
  std::string attr = "#stablehlo.scatter<";
  std::vector<std::string> parts;
  if (!dn.update_window_dims.empty()) parts.push_back("update_window_dims = " + list(dn.update_window_dims));
  if (!dn.inserted_window_dims.empty()) parts.push_back("inserted_window_dims = " + list(dn.inserted_window_dims));
  if (!dn.input_batching_dims.empty()) parts.push_back("input_batching_dims = " + list(dn.input_batching_dims));
  if (!dn.scatter_indices_batching_dims.empty())
    parts.push_back("scatter_indices_batching_dims = " + list(dn.scatter_indices_batching_dims));
  parts.push_back("scatter_dims_to_operand_dims = " + list(dn.scatter_dims_to_operand_dims));
  parts.push_back("index_vector_dim = " + std::to_string(dn.index_vector_dim));
  for (size_t i = 0; i < parts.size(); ++i) attr += (i ? ", " : "") + parts[i];
  attr += ">";
  TensorType scalar{operand.element(), {}};
  Region update = combine ? reducer_region(*combine, operand.element())
                          : region({scalar, scalar}, [](Builder&, const std::vector<Value>& x) -> std::vector<Value> {
                              return {x[1]};  // the update replaces the value
                            });
  return emit("scatter", {operand, indices, updates},
              "{indices_are_sorted = false, scatter_dimension_numbers = " + attr + ", unique_indices = false}",
              operand.type, {update});
}

std::vector<Value> Builder::sort(const std::vector<Value>& input, int64_t dim, bool descending, bool stable) {
  std::vector<Value> operands = input;
  const bool keyed = is_float(input[0].element());
  if (keyed) {
    // torch compares -0.0 equal to 0.0 (a stable sort keeps their input order) and puts every NaN last,
    // whatever its sign; TOTALORDER orders -0 < 0 and -NaN first. So the sort runs on a key with both
    // zeros made +0 and every NaN made +NaN, and returns the original values.
    Value x = input[0];
    Value zero = constant(0, x.element(), x.dims());
    Value key = select(compare(x, x, Compare::NE), constant(NAN, x.element(), x.dims()),
                       select(compare(x, zero, Compare::EQ), zero, x));
    operands.insert(operands.begin(), key);
  }
  // The comparator sees each operand's pair of elements; only the key's decide.
  std::vector<TensorType> args;
  for (const Value& v : operands) args.insert(args.end(), 2, TensorType{v.element(), {}});
  Region comparator = region(args, [&](Builder& r, const std::vector<Value>& x) -> std::vector<Value> {
    // TOTALORDER puts NaN last ascending (first descending), as torch.sort does.
    std::string attrs = compare_attr(descending ? Compare::GT : Compare::LT);
    if (is_float(x[0].element()))
      attrs.insert(attrs.size() - 1, ", compare_type = #stablehlo<comparison_type TOTALORDER>");
    return {r.emit("compare", {x[0], x[1]}, attrs, TensorType{ElementType::Pred, {}})};
  });
  std::vector<TensorType> types;
  for (const Value& v : operands) types.push_back(v.type);
  std::vector<Value> sorted = emit_multi(
      "sort", operands, "{dimension = " + std::to_string(dim) + " : i64, is_stable = " + (stable ? "true" : "false") + "}",
      types, {comparator});
  if (keyed) sorted.erase(sorted.begin());
  return sorted;
}

std::vector<Value> Builder::rng_bit_generator(Value state, TensorType bits_type) {
  return emit_multi("rng_bit_generator", {state}, "{rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>}",
                    {state.type, bits_type});
}

namespace {
// dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>; every row has the same length.
std::string groups_attr(const std::vector<Dims>& rows, size_t row_length) {
  std::string text = "dense<[";
  for (size_t i = 0; i < rows.size(); ++i) {
    PJRT_CHECK(rows[i].size() == row_length, "internal: replica groups of different sizes");
    text += (i ? ", " : "") + list(rows[i]);
  }
  return text + "]> : tensor<" + std::to_string(rows.size()) + "x" + std::to_string(row_length) + "xi64>";
}
int64_t group_size(const std::vector<Dims>& groups) {
  PJRT_CHECK(!groups.empty() && !groups[0].empty(), "internal: empty replica groups");
  return static_cast<int64_t>(groups[0].size());
}
}  // namespace

Value Builder::nan_propagating_collective(Value x, Reducer reducer,
                                          const std::function<Value(Value, Reducer)>& reduce_op) {
  Value r = reduce_op(x, reducer);
  if (!is_float(x.element()) || (reducer != Reducer::Max && reducer != Reducer::Min)) return r;
  // The collective's region is a bare maximum/minimum; a second reduction says where any replica had a NaN.
  Value one = constant(1, x.element(), x.dims()), zero = constant(0, x.element(), x.dims());
  Value nan_seen = reduce_op(select(compare(x, x, Compare::NE), one, zero), Reducer::Max);
  Value nan = constant(std::nan(""), r.element(), r.dims());
  return select(compare(nan_seen, constant(0, r.element(), r.dims()), Compare::GT), nan, r);
}

Value Builder::all_reduce(Value x, Reducer reducer, const ReplicaGroups& groups) {
  return nan_propagating_collective(x, reducer, [&](Value v, Reducer red) {
    return emit("all_reduce", {v}, "{replica_groups = " + groups_attr(groups, group_size(groups)) + "}", v.type,
                {reducer_region(red, v.element(), false)});
  });
}

Value Builder::all_gather(Value x, int64_t dim, const ReplicaGroups& groups) {
  PJRT_CHECK(dim >= 0 && dim < x.rank(), "internal: all_gather over dim ", dim, " of ", x.type.str());
  TensorType out = x.type;
  out.dims[dim] *= group_size(groups);
  return emit("all_gather", {x},
              "{all_gather_dim = " + std::to_string(dim) + " : i64, replica_groups = " +
                  groups_attr(groups, group_size(groups)) + "}",
              out);
}

Value Builder::reduce_scatter(Value x, int64_t dim, Reducer reducer, const ReplicaGroups& groups) {
  int64_t n = group_size(groups);
  PJRT_CHECK(dim >= 0 && dim < x.rank() && x.dims()[dim] % n == 0, "internal: reduce_scatter of ", x.type.str(),
             " over dim ", dim, " among ", n, " replicas");
  return nan_propagating_collective(x, reducer, [&](Value v, Reducer red) {
    TensorType out = v.type;
    out.dims[dim] /= n;
    return emit("reduce_scatter", {v},
                "{replica_groups = " + groups_attr(groups, n) + ", scatter_dimension = " + std::to_string(dim) +
                    " : i64}",
                out, {reducer_region(red, v.element(), false)});
  });
}

Value Builder::all_to_all(Value x, int64_t dim, const ReplicaGroups& groups) {
  int64_t n = group_size(groups);
  PJRT_CHECK(dim >= 0 && dim < x.rank() && x.dims()[dim] % n == 0, "internal: all_to_all of ", x.type.str(),
             " over dim ", dim, " among ", n, " replicas");
  std::string d = std::to_string(dim) + " : i64";
  return emit("all_to_all", {x},
              "{concat_dimension = " + d + ", replica_groups = " + groups_attr(groups, n) + ", split_count = " +
                  std::to_string(n) + " : i64, split_dimension = " + d + "}",
              x.type);
}

Value Builder::replica_id() { return emit("replica_id", {}, "", TensorType{ElementType::U32, {}}); }

Value Builder::collective_permute(Value x, const std::vector<std::pair<int64_t, int64_t>>& source_target_pairs) {
  std::vector<Dims> pairs;
  for (const auto& [source, target] : source_target_pairs) pairs.push_back({source, target});
  PJRT_CHECK(!pairs.empty(), "internal: collective_permute without pairs");
  return emit("collective_permute", {x}, "{source_target_pairs = " + groups_attr(pairs, 2) + "}", x.type);
}

std::string Builder::finish(const std::vector<Value>& results, const std::map<int, int>& aliases) const {
  std::string text = "module @torch_pjrt {\n  func.func public @main(";
  for (size_t i = 0; i < params_.size(); ++i) {
    if (i) text += ", ";
    text += "%arg" + std::to_string(i) + ": " + params_[i].str();
    auto alias = aliases.find(static_cast<int>(i));
    if (alias == aliases.end()) continue;
    int result = alias->second;
    if (result < 0 || result >= static_cast<int>(results.size()) || !(results[result].type == params_[i]))
      throw std::invalid_argument("parameter " + std::to_string(i) + " cannot alias result " + std::to_string(result) +
                                  ": types differ");
    text += " {tf.aliasing_output = " + std::to_string(result) + " : i32}";
  }
  text += ") -> (";
  for (size_t i = 0; i < results.size(); ++i) text += (i ? ", " : "") + results[i].type.str();
  text += ") {\n" + body_ + "    \"func.return\"(";
  std::string types;
  for (size_t i = 0; i < results.size(); ++i) {
    text += (i ? ", " : "") + results[i].name;
    types += (i ? ", " : "") + results[i].type.str();
  }
  text += ") : (" + types + ") -> ()\n  }\n";
  for (const auto& [symbol, definitions] : functions_) text += definitions + "\n";
  text += "}\n";
  if (locations_.empty()) return text;
  text += kLocationsMarker;
  for (size_t i = 0; i < locations_.size(); ++i) text += "#op" + std::to_string(i) + " = " + locations_[i] + "\n";
  return text;
}

}  // namespace torch_pjrt::hlo
