// torch.profiler events for torch_pjrt's own work: compiles and program runs.
#pragma once
#include <ATen/record_function.h>

#include <string>
#include <unordered_map>
#include <utility>

namespace torch_pjrt {

// A user-scope RecordFunction: Kineto shows it in the Chrome trace as
// "torch_pjrt::compile(...)" / "torch_pjrt::execute(...)" with its duration.
// `describe` runs only while a profiler is active and returns {name, ops}; the
// op list is the record's keyword input "ops" (a string), an argument of the
// trace event with record_shapes=True (positional string inputs are dropped).
class ProfileScope {
 public:
  template <class Describe>
  explicit ProfileScope(Describe describe) : guard_(at::RecordScope::USER_SCOPE) {
    if (!guard_.isActive()) return;
    auto [name, ops] = describe();
    name_ = std::move(name);
    if (guard_.needsInputs()) {
      inputs_.emplace("ops", c10::IValue(std::move(ops)));
      guard_.before(name_, &inputs_);
    } else {
      guard_.before(name_);
    }
  }
  // While a profiler records, runs are waited for so their events last as long as the program.
  bool active() const { return guard_.isActive(); }

 private:
  // Declared before guard_: the record refers to them until it ends.
  std::string name_;
  std::unordered_map<std::string, c10::IValue> inputs_;
  at::RecordFunction guard_;
};

}  // namespace torch_pjrt
