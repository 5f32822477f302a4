// The `tpu` device as PyTorch sees it: the runtime (plugin + client), the
// storage a tensor points at, and the default RNG generators.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "graph/compile_cache.h"
#include "pjrt/client.h"

namespace torch_pjrt {

// What a `tpu` storage holds: a PJRT buffer (null until first written; reads
// of it see zeros) and the storage's size in bytes. The buffer may be of any
// element type and shorter than nbytes after a resize; views reinterpret it.
struct StorageState {
  pjrt::BufferPtr buffer;
  size_t nbytes = 0;
  // Bytes its buffer holds when more than nbytes: a capacity storage (a flat
  // `cat`'s result, rounded up to a power of two) so that a growing sequence
  // keeps one program per capacity bucket. 0: none. Reads use the prefix.
  size_t capacity = 0;
  // Made by `aten::cat`: a sequence that may grow by a cat per step. A float
  // cat of several rows that extends it writes a capacity storage (growth.cpp, flat_cat_of).
  bool grown = false;
  int device = 0;
  // Fused/lazy modes: a recorded op writes this storage; its buffer (a flat
  // `pending_count` x `pending_element`) arrives when the graph runs.
  bool pending = false;
  ElementType pending_element = ElementType::F32;
  int64_t pending_count = 0;
  // Set when the fused graph that was to compute this value failed: reading
  // the storage raises this message instead of returning a stale value.
  std::shared_ptr<const std::string> lost;
  // The device program (runtime_checks.h's begin_program) current when the
  // storage got its first buffer: writes to storages born before a failed
  // check are dropped until its error is raised.
  uint64_t born = 0;
};

// Threads. Ops on any thread read and replace storages' buffers, so every
// access to a StorageState's buffer, pending fields and `lost` holds
// storage_mutex(). Strict/debug execution holds it from reading its operand
// buffers to installing its outputs, which makes each op one atomic
// read-modify-write of its storages, as each in-place op on CPU memory is for
// the values it reads. Execution is asynchronous, so it covers an enqueue,
// not the computation. Fused graphs write these fields under both their own
// lock and this one. Never take the GIL or the fused graph's lock under it.
std::mutex& storage_mutex();
// A reference to the storage's buffer (null: never written): it keeps the
// buffer alive while the caller reads it, whatever other threads install.
pjrt::BufferPtr buffer_of(const StorageState& st);
// Gives the storage a new value (and clears `lost`).
void install_buffer(StorageState& st, pjrt::BufferPtr buffer);

// Hands buffers a program consumed (donated) to a background thread that
// destroys their handles: they hold no device memory, and destroying hundreds
// of them (a compiled optimizer step's parameters and states) cost the
// calling thread about 0.2 ms per step on the CPU plugin.
void release_spent(std::vector<pjrt::BufferPtr> buffers);

// Raises when `st` lost its value to a failed graph.
void check_has_value(const StorageState& st);

StorageState& storage_state(const c10::Storage& storage);
// The bytes a program sees for a storage: its capacity when it has one, else nbytes.
inline size_t extent_bytes(const StorageState& st) { return std::max(st.nbytes, st.capacity); }

// The plugin's address of the buffer behind a storage (0: no buffer yet).
// Tests use it to see buffer reuse; the caller flushes pending graphs first.
uintptr_t storage_buffer_address(const StorageState& state);

// Pinned host memory (`pin_memory()`): blocks from the PrivateUse1 hooks'
// pinned allocator. A non_blocking upload from one does not wait for the
// transfer; `source` (the tensor owning that memory) stays referenced until
// `done` fires, and synchronize() waits for all of them.
bool is_pinned_host_ptr(const void* data);
void hold_until_transferred(std::unique_ptr<pjrt::Event> done, at::Tensor source);
void wait_host_transfers();
size_t pending_host_transfers();  // held sources not yet released (tests)

enum class Mode { Debug, Strict, Fused, Lazy };
// The calling thread's mode: its own (set_thread_mode, a ThreadMode scope) if it has one, else the process's.
Mode mode();
// The process's mode (TORCH_PJRT_MODE, torch_pjrt.set_mode): every thread without a mode of its own runs in it.
Mode process_mode();
void set_mode(Mode mode);
// The calling thread's own mode (nullopt: the process's); returns the previous one. Other threads keep theirs:
// a compiled call records in fused mode while another thread runs its ops strictly.
std::optional<Mode> set_thread_mode(std::optional<Mode> mode);
std::optional<Mode> thread_mode();  // the calling thread's own mode, if it has one

// RAII: the calling thread runs in `mode` until the scope ends. (Bindings flush pending graphs around a switch;
// this scope does not: a graph recorded under one mode runs whenever a cut point comes.)
class ThreadMode {
 public:
  explicit ThreadMode(Mode mode) : previous_(set_thread_mode(mode)) {}
  ~ThreadMode() { set_thread_mode(previous_); }
  ThreadMode(const ThreadMode&) = delete;
  ThreadMode& operator=(const ThreadMode&) = delete;

 private:
  std::optional<Mode> previous_;
};

// Runs any recorded graph, then waits for all work enqueued so far on every
// device (or on `device`) and for non_blocking uploads; raises failed checks.
void synchronize();
void synchronize(int device);

// The runtime is created on first use from the configured plugin.
// `platform` ("cpu", "cuda", "tpu" or "" when unknown) picks the client's
// create options.
void configure_plugin(const std::string& path, const std::string& platform);
// No device: every use raises `reason` (the import found a bad setting; import itself must not raise).
void configure_unavailable(const std::string& reason);
// The persistent compile cache's directory; empty: memory only.
std::string compile_cache_dir();
const std::string& plugin_path();
pjrt::Client& client();
// (free, total) bytes of a device: the plugin's memory statistics, or the
// host's available and total memory where device memory is host memory (the
// CPU plugin reports none). torch.accelerator.get_memory_info and
// torch.tpu.mem_get_info read it.
std::pair<size_t, size_t> memory_info(int device);
graph::CompileCache& compile_cache();
bool runtime_started();

// fork() after the runtime started leaves the child a runtime without the
// plugin's threads: any device work would hang. As CUDA does, the child is in
// a "bad fork": every device entry point (allocation, ops, copies, reads,
// sync) raises at once; CPU work, tensor metadata, device_count() and freeing
// inherited tensors (leaked, not released) keep working.
bool in_bad_fork();
void check_not_forked();

int device_count();
int current_device();
void set_current_device(int index);
void check_device_index(int64_t index);
// Raises a failure of the device as PyTorch does: out of memory as
// torch.OutOfMemoryError (what accelerate's batch-size finder catches), the rest as RuntimeError.
[[noreturn]] void raise_device_error(const std::string& message);

// Resizes a storage (its buffer stays; bytes past it read as zeros), counted in the memory statistics.
void set_storage_bytes(const c10::Storage& storage, size_t nbytes);
// Bytes held by live storages on `device` (current and peak).
int64_t memory_allocated(int device);
int64_t max_memory_allocated(int device);
void reset_peak_memory(int device);

// Counter-based RNG: a (seed, offset) pair; each draw takes a fresh offset.
struct RngDraw {
  uint64_t seed;
  uint64_t offset;
};
RngDraw next_rng_draw(const std::optional<at::Generator>& gen, int device, uint64_t count);
// A random op's state operand: the draw's (seed, offset) as two u64 on `device`.
pjrt::BufferPtr rng_state_buffer(RngDraw draw, int device);
// How far a draw of `count` numbers advances the generator's offset.
uint64_t rng_numbers_reserved(uint64_t count);
const at::Generator& default_generator(int device);

}  // namespace torch_pjrt
