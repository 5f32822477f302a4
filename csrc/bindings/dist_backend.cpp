// The c10d Backend behind `tpu_dist`: every collective is forwarded to a
// Python object (torch_pjrt/distributed.py), which picks the path (today:
// staged through Gloo). torch binds c10d::Backend without a Python trampoline,
// and a Python ProcessGroup subclass would not be reached by C++ callers that
// go through the c10d dispatcher (functional collectives, DTensor), so this
// small C++ subclass is the bridge: it is what the dispatcher finds for the
// PrivateUse1 device.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PyProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "bindings/dist_backend.h"

namespace py = pybind11;

namespace torch_pjrt {
namespace {

using c10d::Work;
using TensorList = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;

class PythonBridgeBackend : public c10d::Backend {
 public:
  PythonBridgeBackend(int rank, int size, py::object impl) : Backend(rank, size), impl_(std::move(impl)) {}

  ~PythonBridgeBackend() override {
    py::gil_scoped_acquire gil;  // the last reference may drop on a c10d thread
    impl_ = py::object();
  }

  const std::string getBackendName() const override { return "tpu_dist"; }

  c10::intrusive_ptr<Work> broadcast(TensorList& tensors, const c10d::BroadcastOptions& opts) override {
    return call("broadcast", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce(TensorList& tensors, const c10d::AllreduceOptions& opts) override {
    return call("allreduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(TensorList& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    return call("allreduce_coalesced", tensors, opts);
  }
  c10::intrusive_ptr<Work> reduce(TensorList& tensors, const c10d::ReduceOptions& opts) override {
    return call("reduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allgather(TensorLists& outputs, TensorList& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    return call("allgather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    return call("_allgather_base", output, input, opts);
  }
  c10::intrusive_ptr<Work> allgather_coalesced(TensorLists& outputs, TensorList& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    return call("allgather_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(TensorList& outputs, TensorList& inputs,
                                                           const c10d::AllgatherOptions& opts) override {
    return call("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> gather(TensorLists& outputs, TensorList& inputs, const c10d::GatherOptions& opts) override {
    return call("gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> scatter(TensorList& outputs, TensorLists& inputs,
                                   const c10d::ScatterOptions& opts) override {
    return call("scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter(TensorList& outputs, TensorLists& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    return call("_reduce_scatter_base", output, input, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(TensorList& outputs, TensorList& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override {
    return call("alltoall_base", output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<Work> alltoall(TensorList& outputs, TensorList& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    return call("alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> send(TensorList& tensors, int dst, int tag) override {
    return call("send", tensors, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(TensorList& tensors, int src, int tag) override {
    return call("recv", tensors, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(TensorList& tensors, int tag) override {
    return call("recv_anysource", tensors, tag);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override { return call("barrier", opts); }

  void setTimeout(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    impl_.attr("set_timeout")(timeout.count() / 1000.0);
  }

 private:
  // The Python method returns a c10d Work (a Python subclass or one made from
  // a future); the holder keeps that Python object alive with the C++ one.
  template <typename... Args>
  c10::intrusive_ptr<Work> call(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    py::object work = impl_.attr(name)(args...);
    return c10::make_intrusive<c10d::PyProcessGroup::PyWorkHolder>(work);
  }

  py::object impl_;
};

}  // namespace

void register_dist_backend_bindings(py::module& m) {
  // Returns the backend as torch's own c10d.Backend type, ready for
  // ProcessGroup._register_backend.
  m.def("_make_dist_backend", [](int rank, int size, py::object impl) -> c10::intrusive_ptr<c10d::Backend> {
    return c10::make_intrusive<PythonBridgeBackend>(rank, size, std::move(impl));
  });
}

}  // namespace torch_pjrt
