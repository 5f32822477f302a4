// Tensors are (storage, offset, sizes, strides) over a flat storage buffer.
// These functions turn a strided view of a flat 1-D storage value into a dense
// value and back, so every program takes whole storages as inputs and returns
// whole storages for the tensors it writes. This keeps PyTorch's storage-based
// views exact: writing through a view updates its base.
#pragma once
#include <optional>

#include "hlo/builder.h"

namespace torch_pjrt::graph {

struct StridedView {
  ElementType element;
  hlo::Dims sizes;
  hlo::Dims strides;
  int64_t offset = 0;
  // Set: the offset is this s64[] runtime value instead (`offset` is 0), so
  // a loop over slices of one storage reuses one program.
  std::optional<hlo::Value> runtime_offset;
  // Non-empty: per dim, the stride as an s64[] runtime value (unset for a
  // size-1 dim), read and written with a gather/scatter; `strides` are then
  // not used by the program.
  std::vector<std::optional<hlo::Value>> runtime_strides;
  int64_t numel() const;
  int64_t extent() const;  // 1 + the largest element index relative to the offset
  bool is_dense_row_major() const;  // contiguous, ignoring size-1 dims
};

// The storage as `count` elements of `element`: reinterprets the bytes of
// `buffer` (any element type) and pads or trims it; zeros if there is none.
hlo::Value storage_as(hlo::Builder& b, const std::optional<hlo::Value>& buffer, ElementType element, int64_t count);

// Dense value of shape view.sizes read from flat storage `flat`.
hlo::Value read_view(hlo::Builder& b, const hlo::Value& flat, const StridedView& view);

// `flat` with the elements of `view` replaced by `value` (shape view.sizes).
hlo::Value write_view(hlo::Builder& b, const hlo::Value& flat, const hlo::Value& value, const StridedView& view);

}  // namespace torch_pjrt::graph
