// torch.accelerator.Graph on tpu: PyTorch's device-generic capture and replay
// (CUDA graphs' API) over a captured fused graph (fused_graph.cpp, "graph
// capture"). A captured training step is one XLA program per replay, with no
// Python, dispatch or recording on the host: the lowest host cost a step has.
#include <ATen/core/GraphImplInterface.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <fstream>

#include "aten/device.h"
#include "aten/executor.h"
#include "aten/fused_graph.h"

namespace torch_pjrt {
namespace {

struct TpuGraph final : at::GraphImplInterface {
  explicit TpuGraph(const at::GraphImplArgs&) : pool_id_(next_pool_id()) {}
  ~TpuGraph() override {
    if (device_ < 0) return;
    try {  // destroyed mid-capture: end it, so the device records and runs again
      end_capture(device_, false);
    } catch (...) {
    }
  }

  // `pool` and `mode` are accepted and unused: a replay's results get fresh
  // buffers whatever the pool, and every thread's ops on the device are captured.
  void capture_begin(at::MempoolId_t, at::GraphCaptureMode) override {
    TORCH_CHECK(!graph_, "capture_begin(): this graph holds a capture already; reset() it to capture again");
    TORCH_CHECK(device_ < 0, "capture_begin(): this graph is capturing already");
    int device = current_device();
    begin_capture(device);
    device_ = device;
  }

  void capture_end() override {
    TORCH_CHECK(device_ >= 0, "capture_end(): this graph is not capturing (call capture_begin() first)");
    int device = device_;
    device_ = -1;
    graph_ = end_capture(device, debug_);
    // A strict or debug user's ops on other devices were recorded meanwhile: run them now.
    if (mode() == Mode::Strict || mode() == Mode::Debug) flush_pending();
  }

  void instantiate() override {
    TORCH_CHECK(graph_, "instantiate(): nothing was captured");  // the program was compiled by capture_end()
  }

  void replay() override {
    TORCH_CHECK(graph_, "replay(): nothing was captured; capture the graph first (with graph: ...)");
    replay_captured(*graph_);
  }

  void reset() override {
    TORCH_CHECK(device_ < 0, "reset(): this graph is capturing; end the capture first");
    graph_.reset();
  }

  at::MempoolId_t pool() const override { return {pool_id_, 0}; }

  void enable_debug_mode() override { debug_ = true; }

  // The captured program's StableHLO text.
  void debug_dump(const std::string& path) override {
    TORCH_CHECK(debug_, "debug_dump(): call enable_debug_mode() before the capture");
    TORCH_CHECK(graph_, "debug_dump(): nothing was captured");
    TORCH_CHECK(!captured_program_text(*graph_).empty(),
                "debug_dump(): the capture kept no program text (call enable_debug_mode() before capturing)");
    std::ofstream out(path);
    TORCH_CHECK(out, "debug_dump(): cannot write ", path);
    out << captured_program_text(*graph_);
  }

 private:
  static uint64_t next_pool_id() {
    static std::atomic<uint64_t> next{1};
    return next++;
  }
  const uint64_t pool_id_;
  int device_ = -1;  // while capturing
  bool debug_ = false;
  std::shared_ptr<CapturedGraph> graph_;
};

}  // namespace

// After the backend is renamed: the registry is keyed by the device type's name.
void register_graph_impl() {
  std::string key = c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/false);
  if (!at::GraphImplRegistry()->Has(key))
    at::GraphImplRegistry()->Register(key, [](const at::GraphImplArgs& args) -> std::unique_ptr<at::GraphImplInterface> {
      return std::make_unique<TpuGraph>(args);
    });
}

}  // namespace torch_pjrt
