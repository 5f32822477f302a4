#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_nn(Table&) {}
}  // namespace torch_pjrt::lowering
