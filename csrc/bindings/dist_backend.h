#pragma once
#include <pybind11/pybind11.h>

namespace torch_pjrt {
// _C._make_dist_backend(rank, size, impl): the tpu_dist c10d backend (dist_backend.cpp).
void register_dist_backend_bindings(pybind11::module& m);
}  // namespace torch_pjrt
