#include "graph/source_location.h"

namespace torch_pjrt::graph {
namespace {
SourceLocationHooks g_hooks;
}  // namespace

void set_source_location_hooks(SourceLocationHooks hooks) { g_hooks = hooks; }

SourceLocation capture_source_location() { return g_hooks.capture ? g_hooks.capture() : 0; }

std::string describe_source_location(SourceLocation location) {
  if (location == 0 || !g_hooks.describe) return "an unknown line (no Python frame, e.g. inside autograd's backward)";
  return g_hooks.describe(location);
}

std::pair<std::string, int> source_file_line(SourceLocation location) {
  if (location == 0 || !g_hooks.describe) return {"", 0};
  std::string text = g_hooks.describe(location);  // "file:line in function"
  size_t in = text.rfind(" in ");
  size_t colon = text.rfind(':', in);
  if (in == std::string::npos || colon == std::string::npos || colon + 1 >= in) return {"", 0};
  int line = 0;
  for (size_t i = colon + 1; i < in; ++i) {
    if (text[i] < '0' || text[i] > '9') return {"", 0};
    line = line * 10 + (text[i] - '0');
  }
  return {text.substr(0, colon), line};
}

}  // namespace torch_pjrt::graph
