#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_shape(Table&) {}
}  // namespace torch_pjrt::lowering
