// Streams of a tpu device: their ids, priorities and each thread's current one.
//
// PJRT has no user compute streams: a device runs programs as their buffers
// allow. A stream is therefore a name for a sequence of work, which is what
// query, synchronize and events need: each program or copy enqueued is tagged
// with the streams whose ops it carries (Work::streams, a bit per stream), and
// a stream is idle when no work tagged with it is in flight. Order between
// streams on one device comes from the data (a program reads the buffers an
// earlier one wrote), so wait_stream / wait_event within a device need no
// action; across devices the waiting side waits for the event (device.cpp).
#pragma once
#include <cstdint>

namespace torch_pjrt {

// Id 0 is the default stream. Ids 1..31 are the pool of normal-priority
// streams, 32..62 the high-priority pool (priority -1, CUDA's greatest). Every
// id has a bit in a 64-bit mask, so a piece of work names its streams in one word.
constexpr int64_t kDefaultStream = 0;
constexpr int64_t kStreamsPerPool = 31;
constexpr int64_t kHighPriorityFirst = 1 + kStreamsPerPool;
constexpr int kHighestPriority = -1;

// The stream's bit in a work's or a graph's stream mask (checks the id).
uint64_t stream_bit(int64_t id);
// 0 or kHighestPriority.
int stream_priority(int64_t id);
// The next stream of the pool for `priority` (<= -1: high), round robin per device as CUDA's pools.
int64_t pool_stream(int device, int priority);
// This thread's current stream on `device` (the default stream unless set).
int64_t current_stream(int device);
void set_current_stream(int device, int64_t id);

}  // namespace torch_pjrt
