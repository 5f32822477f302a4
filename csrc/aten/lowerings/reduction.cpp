#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_reduction(Table&) {}
}  // namespace torch_pjrt::lowering
