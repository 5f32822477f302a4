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

}  // namespace torch_pjrt::graph
