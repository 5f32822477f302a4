// Functions from outside torch_pjrt inlined into its programs: JAX kernels
// (torch_pjrt.jax_op). Python lowers the JAX function to StableHLO, renames its
// symbols to a unique prefix and registers the text under a key (its hash and
// argument types); the op torch_pjrt::jax_call(Tensor[] args, str module)
// then lowers to a func.call of it, in every mode.
#include <map>
#include <mutex>

#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

struct ExternalFunction {
  std::string symbol;       // the callee, defined in `definitions`
  std::string definitions;  // func.func ops in generic form
  std::string unsupported;  // why the device cannot run it (custom calls the plugin lacks); empty if it can
};

std::mutex g_external_mutex;
std::map<std::string, ExternalFunction>& external_functions() {
  static auto* functions = new std::map<std::string, ExternalFunction>();  // never destroyed
  return *functions;
}

ExternalFunction find_external(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_external_mutex);
  auto it = external_functions().find(key);
  if (it == external_functions().end())
    throw std::invalid_argument("torch_pjrt::jax_call: no function registered under '" + key + "'");
  return it->second;
}

std::vector<Value> lower_jax_call(Context& c) {
  ExternalFunction f = find_external(c.string_arg("module"));
  // Not a compile error inside a fused graph: the op runs on the CPU in every mode.
  if (!f.unsupported.empty()) throw Unsupported(f.unsupported);
  std::vector<Value> operands;
  for (const auto& v : c.tensor_list("args")) {
    if (!v) throw std::invalid_argument("torch_pjrt::jax_call: undefined tensor argument");
    operands.push_back(*v);
  }
  std::vector<TensorType> results;
  for (size_t i = 0; i < c.output_count(); ++i) results.push_back(TensorType{c.output(i).element, c.output(i).dims});
  return c.b.call(f.symbol, f.definitions, operands, results);
}

}  // namespace

std::vector<Value> call_external(Context& c, const std::string& key, const std::vector<Value>& operands) {
  ExternalFunction f = find_external(key);
  if (!f.unsupported.empty()) throw Unsupported(f.unsupported);
  std::vector<TensorType> results;
  for (size_t i = 0; i < c.output_count(); ++i) results.push_back(TensorType{c.output(i).element, c.output(i).dims});
  return c.b.call(f.symbol, f.definitions, operands, results);
}

void register_external_function(const std::string& key, const std::string& symbol, const std::string& definitions,
                                const std::string& unsupported) {
  std::lock_guard<std::mutex> lock(g_external_mutex);
  external_functions().insert_or_assign(key, ExternalFunction{symbol, definitions, unsupported});
}

void register_external(Table& t) { add_lowering(t, "torch_pjrt::jax_call", lower_jax_call); }

}  // namespace torch_pjrt::lowering
