// Installs the graph layer's source-location hook for Python callers.
#pragma once
#include <Python.h>

#include <string>
#include <vector>

namespace torch_pjrt {

// Frames whose file lies under one of `library_dirs` (torch, torch_pjrt) are
// skipped: the location is the user's own line that led to the op.
void install_python_location_hook(std::vector<std::string> library_dirs);

// Names the user's line behind FX-generated code (compiled graphs):
// resolver(file, line) -> str or None, asked once per new generated line.
void set_generated_code_resolver(PyObject* resolver);

}  // namespace torch_pjrt
