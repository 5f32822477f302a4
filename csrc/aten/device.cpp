// Allocator, device guard, hooks and generators for PrivateUse1 (`tpu`).
#include "aten/device.h"
#include "aten/runtime_checks.h"
#include "aten/device_context.h"
#include "aten/exit_gate.h"
#include "aten/streams.h"
#include "aten/fused_graph.h"
#include "graph/settings.h"
#include "aten/lowering.h"
#include "pjrt/error.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <thread>
#include <cstdlib>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

namespace torch_pjrt {
namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;

struct Runtime {
  std::shared_ptr<pjrt::Client> client;
  std::unique_ptr<graph::CompileCache> cache;
};

std::atomic<bool> g_started{false};
std::atomic<bool> g_bad_fork{false};

std::string& configured_path() {
  static std::string path;
  return path;
}
std::string& configured_platform() {
  static std::string platform;
  return platform;
}
// Why the device cannot start (a bad TORCH_PJRT_PLUGIN or TORCH_PJRT_MODE at import): said on first use.
std::string& unavailable_reason() {
  static std::string reason;
  return reason;
}

// PJRT_Client_Create rejects options a plugin does not know, so each platform
// gets its own. The CUDA plugin would otherwise reserve 75% of the GPU at start;
// growing on demand lets PyTorch's CUDA tensors and JAX share the GPU, as
// PyTorch's own caching allocator does.
std::vector<pjrt::CreateOption> client_options(const std::string& platform) {
  if (platform == "cpu") return {{"cpu_device_count", graph::settings::integer("TORCH_PJRT_CPU_DEVICES", 1)}};
  if (platform == "cuda") {
    std::vector<pjrt::CreateOption> options{{"preallocate", graph::settings::flag("TORCH_PJRT_GPU_PREALLOCATE")}};
    if (auto fraction = graph::settings::number("TORCH_PJRT_GPU_MEMORY_FRACTION"))
      options.push_back({"memory_fraction", static_cast<float>(*fraction)});
    return options;
  }
  return {};
}

}  // namespace

// On by default, as a warm start is ~10x faster: TORCH_PJRT_CACHE_DIR, else
// $XDG_CACHE_HOME/torch_pjrt, else ~/.cache/torch_pjrt. TORCH_PJRT_CACHE_DIR=""
// (or 0 / off) keeps compiled programs in memory only.
std::string compile_cache_dir() {
  if (auto dir = graph::settings::raw("TORCH_PJRT_CACHE_DIR")) return *dir == "0" || *dir == "off" ? "" : *dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/torch_pjrt";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/torch_pjrt";
  return "";
}

namespace {
// The runtime is never destroyed. Caches elsewhere hold buffers and
// executables, and destroying the client at exit before them, or while the
// plugin's threads run, makes PJRT calls on a dead client. The process exit
// reclaims it all.
Runtime& runtime() {
  static Runtime& rt = *new Runtime();
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    try {
      TORCH_CHECK(!configured_path().empty(), unavailable_reason().empty() ? "no PJRT plugin configured: import torch_pjrt first"
                                                                          : unavailable_reason());
      rt.client = pjrt::Client::create(pjrt::Plugin::load(configured_path()), client_options(configured_platform()));
      // Platform rules (lowering.h, find_rule) match the client's platform name: "cpu", "cuda", "tpu".
      std::string platform = rt.client->platform_name();
      std::transform(platform.begin(), platform.end(), platform.begin(), [](unsigned char ch) { return std::tolower(ch); });
      lowering::set_platform(platform);
      std::unique_ptr<graph::DiskCache> disk;
      if (std::string dir = compile_cache_dir(); !dir.empty()) {
        int64_t max_bytes = graph::settings::integer("TORCH_PJRT_CACHE_MAX_BYTES", 0);
        auto& c = *rt.client;
        std::string identity = c.platform_name() + " " + c.platform_version() + " api " +
                               std::to_string(c.plugin()->api_major()) + "." + std::to_string(c.plugin()->api_minor()) +
                               " " + c.device_kind(0);
        disk = std::make_unique<graph::DiskCache>(dir, identity, max_bytes);
      }
      rt.cache = std::make_unique<graph::CompileCache>(rt.client, std::move(disk),
                                                      graph::CompileCache::limits_from_env());
      g_started = true;
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  TORCH_CHECK(rt.cache, "the tpu device could not start: ", error);  // made last: the runtime is complete
  return rt;
}

// The process's mode, fused by default (TORCH_PJRT_MODE picks another): atomic, as any thread may read it
// while another sets it. A thread's own mode (set_thread_mode) comes first.
std::atomic<Mode> g_mode{Mode::Fused};
thread_local std::optional<Mode> t_mode;
thread_local int g_current_device = 0;

// ---- Allocator: a storage is a StorageState; nothing is allocated on the
// device until a program writes the storage.
struct DeviceMemory {
  std::mutex mutex;
  std::vector<c10::CachingDeviceAllocator::DeviceStats> stats;
  c10::CachingDeviceAllocator::DeviceStats& of(int device) {
    if (stats.size() <= static_cast<size_t>(device)) stats.resize(device + 1);
    return stats[device];
  }
};
DeviceMemory& memory() {
  static DeviceMemory m;
  return m;
}
// A live storage counts as allocated, active and reserved alike (nothing is
// cached), so torch.accelerator's and torch.tpu's statistics agree with CUDA's
// meaning. Callers hold memory().mutex.
using StatArray = c10::CachingAllocator::StatArray;
void track_storage(int device, int64_t bytes, int64_t count) {
  auto& s = memory().of(device);
  auto update = [](c10::CachingAllocator::Stat& stat, int64_t amount) {
    if (amount > 0) stat.increase(amount);
    if (amount < 0) stat.decrease(-amount);
  };
  for (StatArray* bytes_stat : {&s.allocated_bytes, &s.active_bytes, &s.reserved_bytes, &s.requested_bytes})
    update((*bytes_stat)[0], bytes);
  for (StatArray* count_stat : {&s.allocation, &s.active, &s.segment}) update((*count_stat)[0], count);
}
template <class Reset>
void reset_stats(int device, Reset reset) {
  auto& s = memory().of(device);
  for (StatArray* stat : {&s.allocated_bytes, &s.active_bytes, &s.reserved_bytes, &s.requested_bytes,
                          &s.allocation, &s.active, &s.segment})
    reset((*stat)[0]);
}

void delete_storage(void* ctx) {
  auto* state = static_cast<StorageState*>(ctx);
  {
    std::lock_guard<std::mutex> lock(memory().mutex);
    track_storage(state->device, -static_cast<int64_t>(state->nbytes), -1);
  }
  delete state;
}

// ---- Pinned host memory: page-aligned blocks this allocator made, so the
// hooks recognise them (`is_pinned()`), and so that a non_blocking copy from
// one may leave the plugin reading it after the call (copy_from in
// registrations.cpp). The CPU plugin reads any host memory; page alignment is
// what a DMA-capable plugin needs to map it.
struct PinnedBlocks {
  std::mutex mutex;
  std::map<uintptr_t, size_t> blocks;  // start -> size
};
PinnedBlocks& pinned_blocks() {
  static auto* b = new PinnedBlocks();  // never destroyed: frees may come at exit
  return *b;
}

// ---- fork: a child of a process whose runtime started is a bad fork (see
// check_not_forked). Freeing inherited tensors is CPU work such a child does
// (DataLoader workers), so fork() holds the allocator's lock: no other thread
// of the parent can hold it at the fork and leave it locked in the child.
void fork_prepare() {
  memory().mutex.lock();
  pinned_blocks().mutex.lock();  // likewise for freeing inherited pinned tensors
}
void fork_parent() {
  pinned_blocks().mutex.unlock();
  memory().mutex.unlock();
}
void fork_child() {
  pinned_blocks().mutex.unlock();
  memory().mutex.unlock();
  if (!g_started) return;  // nothing inherited: the child may start its own runtime
  g_bad_fork = true;
  pjrt::mark_forked_child();
}
const bool g_fork_handlers_registered = pthread_atfork(fork_prepare, fork_parent, fork_child) == 0;

struct TpuAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    check_not_forked();
    auto* state = new StorageState;  // fields by name: a positional init silently shifted when one was added
    state->nbytes = nbytes;
    state->device = current_device();
    {
      std::lock_guard<std::mutex> lock(memory().mutex);
      track_storage(state->device, static_cast<int64_t>(nbytes), 1);
    }
    // The data pointer is the state itself: unique per storage, never dereferenced.
    return {state, state, &delete_storage, c10::Device(kTpu, static_cast<c10::DeviceIndex>(state->device))};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "tpu storages cannot be copied as raw memory; use tensor.copy_()");
  }
  bool initialized() override { return runtime_started(); }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory().mutex);
    return memory().of(device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory().mutex);
    reset_stats(device, [](c10::CachingAllocator::Stat& stat) { stat.reset_accumulated(); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    return memory_info(device < 0 ? current_device() : device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory().mutex);
    reset_stats(device, [](c10::CachingAllocator::Stat& stat) { stat.reset_peak(); });
  }
};

std::pair<size_t, size_t> host_memory() {
  const size_t total = static_cast<size_t>(sysconf(_SC_PAGE_SIZE)) * static_cast<size_t>(sysconf(_SC_PHYS_PAGES));
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  unsigned long long kib = 0;
  while (std::getline(meminfo, line))
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1)
      return {std::min(static_cast<size_t>(kib) * 1024, total), total};
  return {total, total};
}

TpuAllocator g_allocator;
REGISTER_ALLOCATOR(kTpu, &g_allocator);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A torch Event: the programs in flight on its device when it was recorded
// and, if ops were pending, the run of the pending fused graph that covers
// them. Recording does not cut the graph (FSDP2 records an event per stream
// sync); query, synchronize, block and elapsed_time run the graph first if the
// event's point is still in it. It is done when all that work is; its time is
// when the last of it finished (the plugin's completion callback stamps each),
// or the record time if none was running. A timing event runs the pending
// graph at record (the old behaviour): two timing events inside one graph
// would otherwise share one completion stamp and time nothing.
struct TpuEvent {
  int device = -1;
  bool timing = false;
  int64_t recorded_ns = 0;
  std::vector<std::shared_ptr<Work>> work;
  std::shared_ptr<GraphRun> graph_run;  // the pending graph's run, until resolved

  // Recorded on stream `stream`: the stream's work in flight, and the pending graph if it holds the stream's ops.
  void record(int index, bool with_timing, int64_t stream) {
    if (with_timing) flush_pending(index);
    device = index;
    timing = with_timing;
    uint64_t bit = stream_bit(stream);
    graph_run = pending_graph_run(index, bit, work);
    work.erase(std::remove_if(work.begin(), work.end(), [bit](const auto& w) { return !(w->streams & bit); }),
               work.end());
    recorded_ns = now_ns();
  }
  // Runs the graph the event was recorded in (if it has not run) and adds its program to `work`.
  void resolve() {
    if (!graph_run) return;
    flush_through(device, *graph_run);
    // Raises at every use, as waiting on a failed program does.
    TORCH_CHECK(graph_run->failure.empty(), "a tpu program before this event failed: ", graph_run->failure);
    if (graph_run->work) work.push_back(graph_run->work);
    graph_run.reset();
  }
  bool query() {
    resolve();
    for (const auto& w : work)
      if (!w->done->is_ready()) return false;
    return true;
  }
  void synchronize() {
    resolve();
    for (const auto& w : work) {
      try {
        w->done->wait();
      } catch (const pjrt::Error& e) {
        raise_device_error(c10::str("a tpu program before this event failed: ", e.what()));
      }
    }
  }
  // When the event completed; waits for it (and for the completion callbacks,
  // which the plugin may run just after waking waiters).
  int64_t completed_ns() {
    synchronize();
    int64_t t = recorded_ns;
    for (const auto& w : work) {
      while (w->finished_ns->load() == 0) std::this_thread::yield();
      t = std::max(t, w->finished_ns->load());
    }
    return t;
  }
  static double elapsed_ms(TpuEvent& start, TpuEvent& end) {
    TORCH_CHECK(start.device >= 0 && end.device >= 0, "elapsed_time: both events must be recorded first");
    TORCH_CHECK(start.timing && end.timing, "elapsed_time: both events must be created with enable_timing=True");
    return static_cast<double>(end.completed_ns() - start.completed_ns()) / 1e6;
  }
};

// ---- Device guard: devices, streams (streams.h) and events.
struct TpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, static_cast<c10::DeviceIndex>(current_device())); }
  void setDevice(c10::Device d) const override { set_current_device(d.index() < 0 ? 0 : d.index()); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { g_current_device = d.index() < 0 ? 0 : d.index(); }
  static c10::Device on(c10::Device d) {
    return d.index() < 0 ? c10::Device(kTpu, static_cast<c10::DeviceIndex>(current_device())) : d;
  }
  static c10::Stream stream_of(c10::Device d, int64_t id) { return c10::Stream(c10::Stream::UNSAFE, on(d), id); }
  c10::Stream getStream(c10::Device d) const override { return stream_of(d, current_stream(on(d).index())); }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream_of(d, kDefaultStream); }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return stream_of(d, pool_stream(on(d).index(), priority));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return stream_of(d, pool_stream(on(d).index(), high_priority ? kHighestPriority : 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    set_current_stream(on(s.device()).index(), s.id());
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(device_count());
    } catch (...) {
      return 0;
    }
  }
  // An event is its stream's work in flight when it was recorded plus the
  // pending fused graph's run, which it does not cut (see TpuEvent).
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device,
              const c10::EventFlag flag) const override {
    int index = device < 0 ? (stream.device_index() < 0 ? current_device() : stream.device_index()) : device;
    if (!*event) *event = new TpuEvent();
    static_cast<TpuEvent*>(*event)->record(index, flag == c10::EventFlag::BACKEND_DEFAULT, stream.id());
  }
  void block(void* event, const c10::Stream& stream) const override {
    // Same device: its work is ordered by data already (streams.h). Another
    // device: wait for the event, so that the order holds.
    auto* e = static_cast<TpuEvent*>(event);
    if (e && e->device != stream.device_index()) e->synchronize();
  }
  bool queryEvent(void* event) const override { return !event || static_cast<TpuEvent*>(event)->query(); }
  void synchronizeEvent(void* event) const override {
    if (event) static_cast<TpuEvent*>(event)->synchronize();
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "elapsed_time: both events must be recorded first");
    return TpuEvent::elapsed_ms(*static_cast<TpuEvent*>(start), *static_cast<TpuEvent*>(end));
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { delete static_cast<TpuEvent*>(event); }
  bool queryStream(const c10::Stream& stream) const override {
    int index = stream.device_index() < 0 ? current_device() : stream.device_index();
    uint64_t bit = stream_bit(stream.id());
    flush_pending(index);
    for (const auto& work : device_context(index).in_flight_work())
      if ((work->streams & bit) && !work->done->is_ready()) return false;
    return true;
  }
  // Waits for the whole device (every stream): the failures it raises are reported once, as synchronize() does.
  void synchronizeStream(const c10::Stream& stream) const override {
    synchronize(stream.device_index() < 0 ? current_device() : stream.device_index());
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override {
    synchronize(device < 0 ? current_device() : device);
  }
  // A storage's buffer outlives the work that reads it without this: PJRT frees a destroyed buffer's memory
  // only after the programs and copies using it are done.
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuard);

// ---- Generator: (seed, offset) for a counter-based RNG.
struct TpuGenerator final : c10::GeneratorImpl {
  explicit TpuGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kTpu, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t s) override {
    seed_ = s;
    offset_ = 0;
  }
  void set_offset(uint64_t o) override { offset_ = o; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(s);
    return s;
  }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16 && state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
                "tpu RNG state must be a uint8 tensor of 16 bytes (seed, offset)");
    const auto* data = static_cast<const uint64_t*>(state.data());
    seed_ = data[0];
    offset_ = data[1];
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(c10::Storage::use_byte_size_t(), 16, c10::GetCPUAllocator(), true),
        c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<uint8_t>());
    impl->set_sizes_contiguous({16});
    auto* data = static_cast<uint64_t*>(impl->mutable_data());
    data[0] = seed_;
    data[1] = offset_;
    return impl;
  }
  TpuGenerator* clone_impl() const override {
    auto* g = new TpuGenerator(device().index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
  static c10::DeviceType device_type() { return kTpu; }
  uint64_t seed_ = 67280421310721ULL;
  uint64_t offset_ = 0;
};


void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_blocks().mutex);
    pinned_blocks().blocks.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

// Also torch.accelerator's host allocator for tpu (empty_host_cache, host
// memory stats): it caches nothing, so there is no cache to empty and no
// block to keep for an event.
struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* ptr = nullptr;
    size_t size = std::max<size_t>((nbytes + page - 1) / page * page, page);  // a zero-byte storage has a block too
    TORCH_CHECK(posix_memalign(&ptr, page, size) == 0 && ptr, "could not allocate ", nbytes,
                " bytes of pinned host memory");
    {
      std::lock_guard<std::mutex> lock(pinned_blocks().mutex);
      pinned_blocks().blocks[reinterpret_cast<uintptr_t>(ptr)] = size;
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};
PinnedAllocator g_pinned_allocator;
REGISTER_HOST_ALLOCATOR(kTpu, &g_pinned_allocator)

// ---- Hooks.
struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index < 0 ? current_device() : index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<TpuGenerator>(index < 0 ? static_cast<c10::DeviceIndex>(current_device()) : index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return c10::Device(kTpu, static_cast<c10::DeviceIndex>(static_cast<StorageState*>(data)->device));
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_host_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return runtime_started(); }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count()); }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return static_cast<c10::DeviceIndex>(current_device()); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = getCurrentDevice();
    set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_after_graph(storage, newsize);
  }
};

bool register_hooks() {
  static TpuHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}
const bool g_hooks_registered = register_hooks();

// Non_blocking uploads whose host memory the plugin may still read, each with
// the tensor that owns that memory.
struct HostTransfers {
  std::mutex mutex;
  std::deque<std::pair<std::unique_ptr<pjrt::Event>, at::Tensor>> pending;
};
HostTransfers& host_transfers() {
  static auto* t = new HostTransfers();  // never destroyed (see runtime())
  return *t;
}

}  // namespace

bool is_pinned_host_ptr(const void* data) {
  auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(pinned_blocks().mutex);
  auto& blocks = pinned_blocks().blocks;
  auto it = blocks.upper_bound(address);
  if (it == blocks.begin()) return false;
  --it;
  return address < it->first + it->second;
}

void hold_until_transferred(std::unique_ptr<pjrt::Event> done, at::Tensor source) {
  if (!done) return;
  std::lock_guard<std::mutex> lock(host_transfers().mutex);
  auto& pending = host_transfers().pending;
  // Release finished ones from the front, so a steady loader holds a few batches at most.
  while (!pending.empty() && pending.front().first->is_ready()) pending.pop_front();
  pending.emplace_back(std::move(done), std::move(source));
}

void wait_host_transfers() {
  std::deque<std::pair<std::unique_ptr<pjrt::Event>, at::Tensor>> pending;
  {
    std::lock_guard<std::mutex> lock(host_transfers().mutex);
    pending.swap(host_transfers().pending);
  }
  for (auto& [done, source] : pending) {
    try {
      done->wait();
    } catch (const pjrt::Error& e) {
      raise_device_error(c10::str("a non_blocking copy to the tpu device failed: ", e.what()));
    }
  }
}

size_t pending_host_transfers() {
  std::lock_guard<std::mutex> lock(host_transfers().mutex);
  return host_transfers().pending.size();
}

StorageState& storage_state(const c10::Storage& storage) {
  void* ctx = storage.data_ptr().get_context();
  TORCH_CHECK(ctx && storage.data_ptr().get_deleter() == &delete_storage,
              "internal: storage on ", storage.device(), " was not allocated by torch_pjrt");
  return *static_cast<StorageState*>(ctx);
}

std::mutex& storage_mutex() {
  static auto* mutex = new std::mutex();  // never destroyed: storages may die during exit
  return *mutex;
}

pjrt::BufferPtr buffer_of(const StorageState& st) {
  std::lock_guard<std::mutex> lock(storage_mutex());
  return st.buffer;
}

void install_buffer(StorageState& st, pjrt::BufferPtr buffer) {
  std::lock_guard<std::mutex> lock(storage_mutex());
  if (!st.buffer) st.born = current_program(st.device);
  st.buffer.swap(buffer);
  st.lost.reset();
}  // the old buffer is released after the lock (declared before it)

namespace {
struct SpentBuffers {
  std::mutex mutex;
  std::condition_variable ready;
  std::vector<std::vector<pjrt::BufferPtr>> batches;
  bool started = false;
};
SpentBuffers& spent_buffers() {
  static auto* spent = new SpentBuffers();  // never destroyed: the thread outlives static destructors
  return *spent;
}
void destroy_spent_buffers() {
  SpentBuffers& spent = spent_buffers();
  for (;;) {
    std::vector<std::vector<pjrt::BufferPtr>> batches;
    {
      std::unique_lock<std::mutex> lock(spent.mutex);
      spent.ready.wait(lock, [&] { return !spent.batches.empty(); });
      batches.swap(spent.batches);
    }
    ExitGate gate;  // the exit waits while this thread is inside the plugin
    if (device_closed()) {
      new std::vector<std::vector<pjrt::BufferPtr>>(std::move(batches));  // the process is ending: leave them
      return;
    }
    batches.clear();
  }
}
}  // namespace

void release_spent(std::vector<pjrt::BufferPtr> buffers) {
  if (buffers.empty()) return;
  if (pjrt::in_forked_child()) {  // no thread here (and ~Buffer does nothing in a child)
    new std::vector<pjrt::BufferPtr>(std::move(buffers));
    return;
  }
  SpentBuffers& spent = spent_buffers();
  {
    std::lock_guard<std::mutex> lock(spent.mutex);
    if (!spent.started) {
      std::thread(destroy_spent_buffers).detach();
      spent.started = true;
    }
    spent.batches.push_back(std::move(buffers));
  }
  spent.ready.notify_one();
}

void check_has_value(const StorageState& st) {
  std::shared_ptr<const std::string> lost;
  {
    std::lock_guard<std::mutex> lock(storage_mutex());
    lost = st.lost;
  }
  TORCH_CHECK(!lost, "this tpu tensor has no value: ", *lost, ". Assign it again (for example with copy_) to use it.");
}

uintptr_t storage_buffer_address(const StorageState& state) {
  check_not_forked();
  pjrt::BufferPtr buffer = buffer_of(state);
  if (!buffer) return 0;
  buffer->wait_ready();
  return buffer->device_address();
}

Mode mode() { return t_mode ? *t_mode : g_mode.load(std::memory_order_relaxed); }
Mode process_mode() { return g_mode.load(std::memory_order_relaxed); }
void set_mode(Mode m) { g_mode.store(m, std::memory_order_relaxed); }
std::optional<Mode> set_thread_mode(std::optional<Mode> m) { return std::exchange(t_mode, m); }
std::optional<Mode> thread_mode() { return t_mode; }

void configure_plugin(const std::string& path, const std::string& platform) {
  TORCH_CHECK(!runtime_started() || path == configured_path(),
              "the tpu runtime already started with plugin ", configured_path());
  configured_path() = path;
  configured_platform() = platform;
}
void configure_unavailable(const std::string& reason) {
  TORCH_CHECK(!runtime_started(), "the tpu runtime already started with plugin ", configured_path());
  configured_path().clear();
  unavailable_reason() = reason;
}
const std::string& plugin_path() { return configured_path(); }
pjrt::Client& client() {
  check_not_forked();
  return *runtime().client;
}
std::pair<size_t, size_t> memory_info(int device) {
  check_device_index(device);
  auto stats = client().memory_stats(static_cast<size_t>(device));
  if (!stats || stats->bytes_limit < 0) return host_memory();
  const auto limit = static_cast<size_t>(stats->bytes_limit), used = static_cast<size_t>(std::max<int64_t>(stats->bytes_in_use, 0));
  return {limit > used ? limit - used : 0, limit};
}
graph::CompileCache& compile_cache() {
  check_not_forked();
  return *runtime().cache;
}

bool in_bad_fork() { return g_bad_fork; }

void raise_device_error(const std::string& message) {
  TORCH_CHECK_WITH(OutOfMemoryError, !pjrt::is_out_of_memory(message), message);
  TORCH_CHECK(false, message);
}

void check_not_forked() {
  TORCH_CHECK(!g_bad_fork,
              "Cannot use the tpu device in a forked subprocess: the parent started the tpu runtime before fork(), "
              "and a PJRT runtime does not survive fork. To use the tpu device with multiprocessing, use the 'spawn' "
              "start method (for a DataLoader: multiprocessing_context='spawn'), or keep the workers' work on the CPU "
              "and move batches to the device in the parent.");
}

bool runtime_started() { return g_started; }

int device_count() { return static_cast<int>(runtime().client->device_count()); }

int current_device() { return g_current_device; }

void check_device_index(int64_t index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "invalid tpu device index ", index, ": there ",
              device_count() == 1 ? "is 1 device" : "are " + std::to_string(device_count()) + " devices",
              " (platform ", runtime().client->platform_name(), ")");
}

void set_current_device(int index) {
  check_device_index(index);
  g_current_device = index;
}

void set_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  StorageState& state = storage_state(storage);
  {
    std::lock_guard<std::mutex> lock(memory().mutex);
    track_storage(state.device, static_cast<int64_t>(nbytes) - static_cast<int64_t>(state.nbytes), 0);
  }
  state.nbytes = nbytes;
  storage.unsafeGetStorageImpl()->set_nbytes(nbytes);
}

int64_t memory_allocated(int device) {
  std::lock_guard<std::mutex> lock(memory().mutex);
  return memory().of(device).allocated_bytes[0].current;
}
int64_t max_memory_allocated(int device) {
  std::lock_guard<std::mutex> lock(memory().mutex);
  return memory().of(device).allocated_bytes[0].peak;
}
void reset_peak_memory(int device) { g_allocator.resetPeakStats(static_cast<c10::DeviceIndex>(device)); }

const at::Generator& default_generator(int device) { return device_context(device).generator; }

DeviceContext::DeviceContext(int i)
    : index(i),
      graph(make_pending_graph()),
      generator(at::make_generator<TpuGenerator>(static_cast<c10::DeviceIndex>(i))) {}

namespace {
// Made once the runtime knows its devices; never destroyed (see runtime()).
const std::vector<DeviceContext*>& contexts() {
  static const std::vector<DeviceContext*>& all = *[] {
    auto* v = new std::vector<DeviceContext*>();
    for (int i = 0; i < device_count(); ++i) v->push_back(new DeviceContext(i));
    return v;
  }();
  return all;
}
}  // namespace

DeviceContext& device_context(int index) {
  const auto& all = contexts();
  if (index < 0 || static_cast<size_t>(index) >= all.size()) check_device_index(index);  // raises
  return *all[index];
}

std::vector<DeviceContext*> started_device_contexts() {
  if (!runtime_started() || in_bad_fork()) return {};
  return contexts();
}

std::shared_ptr<Work> DeviceContext::track_work(std::unique_ptr<pjrt::Event> done, pjrt::ExecutablePtr program,
                                               uint64_t streams) {
  if (!done) return nullptr;
  if (mode() == Mode::Debug) {
    done->wait();
    return nullptr;
  }
  auto work = std::make_shared<Work>();
  work->done = std::move(done);
  work->program = std::move(program);
  work->streams = streams ? streams : stream_bit(current_stream(index));
  // The callback touches only the stamp: it may run on a plugin thread.
  work->done->on_ready([finished = work->finished_ns] { finished->store(now_ns()); });
  std::lock_guard<std::mutex> lock(work_mutex_);
  pop_finished_work();
  in_flight_.push_back(work);
  return work;
}

namespace {
// Waits for `work`; keeps its failure in `first_failure` unless one is there.
void wait_noting_failure(Work& work, std::string& first_failure) {
  try {
    work.done->wait();
  } catch (const pjrt::Error& e) {
    if (first_failure.empty()) first_failure = e.what();
  }
}
}  // namespace

void DeviceContext::pop_finished_work() {
  while (!in_flight_.empty() && in_flight_.front()->done->is_ready()) {
    auto ready = std::move(in_flight_.front());
    in_flight_.pop_front();
    wait_noting_failure(*ready, unreported_failure_);
  }
}

std::string DeviceContext::take_unreported_failure() {
  std::lock_guard<std::mutex> lock(work_mutex_);
  return std::exchange(unreported_failure_, "");
}

void DeviceContext::failures_reported() {
  std::lock_guard<std::mutex> lock(work_mutex_);
  pop_finished_work();
  unreported_failure_.clear();
}

std::vector<std::shared_ptr<Work>> DeviceContext::in_flight_work() {
  std::lock_guard<std::mutex> lock(work_mutex_);
  return {in_flight_.begin(), in_flight_.end()};
}

std::deque<std::shared_ptr<Work>> DeviceContext::take_in_flight() {
  std::lock_guard<std::mutex> lock(work_mutex_);
  return std::exchange(in_flight_, {});
}

pjrt::BufferPtr rng_state_buffer(RngDraw draw, int device) {
  uint64_t state[2] = {draw.seed, draw.offset};
  return client().buffer_from_host(state, ElementType::U64, {2}, device);
}

uint64_t rng_numbers_reserved(uint64_t count) { return (count + 3) / 4 * 4; }  // Threefry: 4 words per counter block

RngDraw next_rng_draw(const std::optional<at::Generator>& gen, int device, uint64_t count) {
  at::Generator g = gen && gen->defined() ? *gen : default_generator(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  auto* impl = g.get<TpuGenerator>();
  TORCH_CHECK(impl, "expected a tpu generator, got one for ", g.device());
  RngDraw draw{impl->seed_, impl->offset_};
  impl->offset_ += rng_numbers_reserved(count);
  return draw;
}

void synchronize(int device) {
  check_not_forked();
  flush_pending(device);
  wait_host_transfers();  // after this, the sources of non_blocking copies may change
  DeviceContext& ctx = device_context(device);
  std::deque<std::shared_ptr<Work>> pending = ctx.take_in_flight();
  std::string failure = ctx.take_unreported_failure();
  for (auto& work : pending) wait_noting_failure(*work, failure);
  if (!failure.empty()) raise_device_error(c10::str("a tpu program on tpu:", device, " failed: ", failure));
  raise_failed_checks(device);
}

void synchronize() {
  check_not_forked();
  for (DeviceContext* ctx : started_device_contexts()) synchronize(ctx->index);
  wait_host_transfers();
}

}  // namespace torch_pjrt
