#include "aten/streams.h"

#include <c10/util/Exception.h>

#include <vector>

#include "aten/device.h"
#include "aten/device_context.h"

namespace torch_pjrt {
namespace {
// Per thread, as CUDA's current stream: index = device.
thread_local std::vector<int64_t> t_current_streams;

bool valid(int64_t id) { return id >= 0 && id < kHighPriorityFirst + kStreamsPerPool; }
}  // namespace

uint64_t stream_bit(int64_t id) {
  TORCH_CHECK(valid(id), "tpu stream id ", id, " is not a stream of a tpu device (ids are 0 to ",
              kHighPriorityFirst + kStreamsPerPool - 1, ")");
  return uint64_t{1} << id;
}

int stream_priority(int64_t id) { return id >= kHighPriorityFirst ? kHighestPriority : 0; }

int64_t pool_stream(int device, int priority) {
  check_not_forked();  // as torch.cuda.Stream() in a forked child: the device is the parent's
  bool high = priority <= kHighestPriority;
  uint32_t n = device_context(device).next_pool_stream[high ? 1 : 0]++;
  return (high ? kHighPriorityFirst : 1) + static_cast<int64_t>(n % kStreamsPerPool);
}

int64_t current_stream(int device) {
  return static_cast<size_t>(device) < t_current_streams.size() ? t_current_streams[device] : kDefaultStream;
}

void set_current_stream(int device, int64_t id) {
  stream_bit(id);  // checks it
  if (t_current_streams.size() <= static_cast<size_t>(device)) t_current_streams.resize(device + 1, kDefaultStream);
  t_current_streams[device] = id;
}

}  // namespace torch_pjrt
