#include "graph/strided_view.h"

#include <algorithm>
#include <numeric>

#include "pjrt/error.h"

namespace torch_pjrt::graph {

using hlo::Builder;
using hlo::Dims;
using hlo::TensorType;
using hlo::Value;

int64_t StridedView::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

int64_t StridedView::extent() const {
  int64_t last = 0;
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  return last + 1;
}

bool StridedView::is_dense_row_major() const {
  int64_t expected = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

namespace {

// Reinterprets a 1-D value as bytes (ui8), bit for bit.
Value as_bytes(Builder& b, const Value& flat) {
  if (flat.element() == ElementType::U8) return flat;
  int64_t n = flat.dims()[0];
  if (flat.element() == ElementType::Pred) return b.convert(flat, ElementType::U8);
  if (byte_size(flat.element()) == 1) return b.bitcast_convert(flat, TensorType{ElementType::U8, {n}});
  int64_t k = static_cast<int64_t>(byte_size(flat.element()));
  Value bytes = b.bitcast_convert(flat, TensorType{ElementType::U8, {n, k}});
  return b.reshape(bytes, {n * k});
}

Value from_bytes(Builder& b, const Value& bytes, ElementType element) {
  if (element == ElementType::U8) return bytes;
  int64_t n = bytes.dims()[0];
  if (element == ElementType::Pred) return b.compare(bytes, b.constant_int(0, ElementType::U8, {n}), hlo::Compare::NE);
  int64_t k = static_cast<int64_t>(byte_size(element));
  if (k == 1) return b.bitcast_convert(bytes, TensorType{element, {n}});
  Value grouped = b.reshape(b.slice(bytes, {0}, {n / k * k}, {1}), {n / k, k});
  return b.bitcast_convert(grouped, TensorType{element, {n / k}});
}

Value fit_length(Builder& b, const Value& flat, int64_t count) {
  int64_t n = flat.dims()[0];
  if (n == count) return flat;
  if (n > count) return b.slice(flat, {0}, {count}, {1});
  return b.pad(flat, b.constant(0, flat.element()), {0}, {count - n}, {0});
}

// The view's storage offset as an s64[] value.
Value offset_value(Builder& b, const StridedView& view) {
  return view.runtime_offset ? *view.runtime_offset : b.constant_int(view.offset, ElementType::S64);
}

// `size` elements of `flat` from the view's offset. A runtime offset uses
// dynamic_slice, which clamps the start so the slice fits: callers make sure
// offset + size never exceeds the length, so it never shifts.
Value slice_at_offset(Builder& b, const Value& flat, const StridedView& view, int64_t size) {
  if (view.runtime_offset) return b.dynamic_slice(flat, {*view.runtime_offset}, {size});
  return b.slice(flat, {view.offset}, {view.offset + size}, {1});
}

// Flat storage index of every element of the view, shape sizes + [1].
Value element_indices(Builder& b, const StridedView& view) {
  Dims shape = view.sizes;
  Value index = view.runtime_offset ? b.broadcast_in_dim(*view.runtime_offset, shape, {})
                                    : b.constant_int(view.offset, ElementType::S64, shape);
  const bool runtime = !view.runtime_strides.empty();
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1 || (!runtime && view.strides[d] == 0)) continue;
    Value stride = runtime ? b.broadcast_in_dim(*view.runtime_strides[d], shape, {})
                           : b.constant_int(view.strides[d], ElementType::S64, shape);
    Value step = b.binary("multiply", b.iota(TensorType{ElementType::S64, shape}, static_cast<int64_t>(d)), stride);
    index = b.binary("add", index, step);
  }
  Dims with_vector = shape;
  with_vector.push_back(1);
  return b.reshape(index, with_vector);
}

// For a view that is a dense block in some dim order (channels_last, a
// transpose): every dim, size-1 dims first, then outermost to innermost.
std::optional<Dims> dense_order(const StridedView& view) {
  Dims ones, kept;
  for (int64_t d = 0; d < static_cast<int64_t>(view.sizes.size()); ++d)
    (view.sizes[d] == 1 ? ones : kept).push_back(d);
  std::stable_sort(kept.begin(), kept.end(), [&](int64_t x, int64_t y) { return view.strides[x] > view.strides[y]; });
  int64_t expected = 1;
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
    if (view.strides[*it] != expected) return std::nullopt;
    expected *= view.sizes[*it];
  }
  ones.insert(ones.end(), kept.begin(), kept.end());
  return ones;
}

// A complex storage's flat value as its parts interleaved (re, im, re, ...),
// the layout PyTorch's view_as_real sees; and back. XLA's bitcast_convert
// does not take complex types.
Value complex_as_parts(Builder& b, const Value& flat) {
  int64_t n = flat.dims()[0];
  Value re = b.reshape(b.real(flat), {n, 1}), im = b.reshape(b.imag(flat), {n, 1});
  return b.reshape(b.concatenate({re, im}, 1), {2 * n});
}
Value parts_as_complex(Builder& b, const Value& parts) {
  int64_t n = parts.dims()[0] / 2;
  Value pairs = b.reshape(b.slice(parts, {0}, {2 * n}, {1}), {n, 2});
  Value re = b.reshape(b.slice(pairs, {0, 0}, {n, 1}, {1, 1}), {n});
  Value im = b.reshape(b.slice(pairs, {0, 1}, {n, 2}, {1, 1}), {n});
  return b.complex(re, im);
}

}  // namespace

Value storage_as(Builder& b, const std::optional<Value>& buffer, ElementType element, int64_t count) {
  if (!buffer) return b.constant(0, element, {count});
  Value flat = buffer->rank() == 1 ? *buffer : b.reshape(*buffer, {buffer->type.element_count()});
  if (flat.element() != element && is_complex(flat.element())) flat = complex_as_parts(b, flat);
  if (flat.element() != element && is_complex(element)) {
    ElementType part = real_part_type(element);
    return fit_length(b, parts_as_complex(b, storage_as(b, flat, part, 2 * count)), count);
  }
  if (flat.element() != element) {
    bool same_width = byte_size(flat.element()) == byte_size(element) && flat.element() != ElementType::Pred &&
                      element != ElementType::Pred;
    flat = same_width ? b.bitcast_convert(flat, TensorType{element, flat.dims()})
                      : from_bytes(b, as_bytes(b, flat), element);
  }
  return fit_length(b, flat, count);
}

Value read_view(Builder& b, const Value& flat, const StridedView& view) {
  const int64_t rank = static_cast<int64_t>(view.sizes.size());
  if (view.numel() == 0) return b.constant(0, view.element, view.sizes);
  if (!view.runtime_strides.empty()) {
    Builder::GatherDims dn{{}, {0}, {}, {}, {0}, rank};
    return b.gather(flat, element_indices(b, view), dn, {1}, view.sizes);
  }
  if (view.is_dense_row_major()) {
    return b.reshape(slice_at_offset(b, flat, view, view.numel()), view.sizes);
  }
  // Dims that really step through memory, outermost (largest stride) first.
  std::vector<int64_t> kept;
  for (int64_t d = 0; d < rank; ++d)
    if (view.sizes[d] != 1 && view.strides[d] != 0) kept.push_back(d);
  std::stable_sort(kept.begin(), kept.end(),
                   [&](int64_t x, int64_t y) { return view.strides[x] > view.strides[y]; });
  bool boxed = !kept.empty();
  for (size_t i = 1; i < kept.size() && boxed; ++i) {
    int64_t outer = view.strides[kept[i - 1]], inner = view.strides[kept[i]];
    boxed = inner > 0 && outer % inner == 0 && outer >= inner * view.sizes[kept[i]];
  }
  if (boxed && view.strides[kept.back()] > 0) {
    // The view is a sub-box of a dense box [size0, s0/s1, ..., s_last]: slice
    // the box out of the flat storage, cut it down, then permute and broadcast.
    Dims box, keep, zeros;
    for (size_t i = 0; i < kept.size(); ++i) {
      box.push_back(i == 0 ? view.sizes[kept[0]] : view.strides[kept[i - 1]] / view.strides[kept[i]]);
      keep.push_back(view.sizes[kept[i]]);
    }
    box.push_back(view.strides[kept.back()]);
    keep.push_back(1);
    int64_t total = view.sizes[kept[0]] * view.strides[kept[0]];
    int64_t have = flat.dims()[0];
    // The box may reach past the view's last element (by `total - extent`)
    // and so past the storage's end: pad that slack. A runtime offset is not
    // known here, but offset + extent <= have holds for every valid view.
    int64_t reach = view.runtime_offset ? have + total - view.extent() : view.offset + total;
    Value source = flat;
    if (reach > have) source = b.pad(flat, b.constant(0, flat.element()), {0}, {reach - have}, {0});
    Value part = b.reshape(slice_at_offset(b, source, view, total), box);
    Dims ones(box.size(), 1);
    zeros.assign(box.size(), 0);
    Value cut = b.slice(part, zeros, keep, ones);
    keep.pop_back();
    Value sorted = b.reshape(cut, keep);
    std::vector<int64_t> by_index = kept;
    std::sort(by_index.begin(), by_index.end());
    Dims perm;
    for (int64_t d : by_index) perm.push_back(std::find(kept.begin(), kept.end(), d) - kept.begin());
    Value ordered = b.transpose(sorted, perm);
    return b.broadcast_in_dim(ordered, view.sizes, Dims(by_index.begin(), by_index.end()));
  }
  if (kept.empty()) {
    Value one = b.reshape(slice_at_offset(b, flat, view, 1), {});
    return b.broadcast_in_dim(one, view.sizes, {});
  }
  Builder::GatherDims dn{{}, {0}, {}, {}, {0}, rank};
  return b.gather(flat, element_indices(b, view), dn, {1}, view.sizes);
}

Value write_view(Builder& b, const Value& flat, const Value& value, const StridedView& view) {
  const int64_t count = flat.dims()[0];
  const int64_t n = view.numel();
  if (n == 0) return flat;
  const int64_t rank = static_cast<int64_t>(view.sizes.size());
  Builder::ScatterDims dn{{}, {0}, {}, {}, {0}, rank};
  if (!view.runtime_strides.empty()) return b.scatter(flat, element_indices(b, view), value, dn, /*combine=*/std::nullopt);
  if (view.is_dense_row_major()) {
    Value dense = b.reshape(value, {n});
    if (!view.runtime_offset && view.offset == 0 && n == count) return dense;
    return b.dynamic_update_slice(flat, dense, {offset_value(b, view)});
  }
  if (auto order = dense_order(view)) {  // a permuted dense block: transpose into memory order
    Value dense = b.reshape(b.transpose(value, *order), {n});
    if (!view.runtime_offset && view.offset == 0 && n == count) return dense;
    return b.dynamic_update_slice(flat, dense, {offset_value(b, view)});
  }
  return b.scatter(flat, element_indices(b, view), value, dn, /*combine=*/std::nullopt);
}

}  // namespace torch_pjrt::graph
