#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_random(Table&) {}
}  // namespace torch_pjrt::lowering
