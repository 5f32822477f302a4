// Every TORCH_PJRT_* environment variable the runtime and the Python package
// read, in one table that documents it (settings.cpp). Nothing else calls
// getenv for them: C++ reads through these functions, Python through
// `_C._setting*` (python/torch_pjrt/_settings.py), and `python -m torch_pjrt`
// prints the table with the values set.
//
// Values are read when asked, not cached here: a reader that is on a hot path
// keeps its own static copy, and says so.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch_pjrt::graph::settings {

struct Setting {
  const char* name;
  // As the user would write it; "" when unset means off/none. A default in
  // words (the cache directory, the map limit) is computed by its reader, which reads raw().
  const char* default_value;
  const char* what;           // one line for the docs and the diagnosis
};

// The table, in the order the docs list it.
const std::vector<Setting>& all();

// The variable's text, nullopt when it is unset. `name` must be in the table
// (a name missing from it is a bug in the caller and raises).
std::optional<std::string> raw(const std::string& name);
// The text, or the table's default when unset or empty.
std::string text(const std::string& name);
// An on/off switch: 1/0, true/false, on/off, yes/no (any case); unset or empty
// gives the default. Anything else raises std::invalid_argument naming the variable.
bool flag(const std::string& name);
// An integer (unset or empty: the default); at least `minimum`, else raises naming the variable.
int64_t integer(const std::string& name, int64_t minimum = INT64_MIN);
// A number (unset or empty: nullopt).
std::optional<double> number(const std::string& name);

}  // namespace torch_pjrt::graph::settings
