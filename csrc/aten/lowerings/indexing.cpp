#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
void register_indexing(Table&) {}
}  // namespace torch_pjrt::lowering
