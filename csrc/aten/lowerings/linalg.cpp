#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_linalg(Table&) {}
}  // namespace torch_pjrt::lowering
