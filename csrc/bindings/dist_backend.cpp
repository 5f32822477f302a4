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

  // Splitting (split_group; DeviceMesh uses it once init_process_group has a device_id): the Python side makes
  // the child's own Gloo group from the new group's store.
  bool supportsSplitting() const override { return true; }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    return options().cast<c10::intrusive_ptr<Options>>();
  }

  // split_group deep-copies `backend.options`: a Python subclass of Backend.Options that can be copied.
  py::object options() { return impl_.attr("options")(); }

  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    py::object child = impl_.attr("split")(store, ranks, opts->timeout.count() / 1000.0, opts->group_name);
    if (child.is_none()) return nullptr;  // this rank is not in the new group
    return c10::make_intrusive<PythonBridgeBackend>(child.attr("rank").cast<int>(), child.attr("size").cast<int>(),
                                                    child);
  }

  // The collective count (split_group and the flight recorder read it); every rank starts at 0.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    return impl_.attr("_seq").cast<uint64_t>();
  }

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
  // Registered as a subclass of torch's c10d.Backend for the one attribute the base binding lacks.
  py::class_<PythonBridgeBackend, c10d::Backend, c10::intrusive_ptr<PythonBridgeBackend>>(m, "_TpuDistBackend")
      .def_property_readonly("options", [](PythonBridgeBackend& self) {
        py::gil_scoped_acquire gil;
        return self.options();
      })
      // new_group on a rank outside the new group, once init_process_group had a device_id: torch calls this
      // on the default group's backend (NCCL's ncclCommSplit needs every rank). tpu_dist's groups need nothing
      // from non-members. torch <= 2.12's DeviceMesh takes this path (split_group only when CUDA is available).
      .def("perform_nocolor_split", [](PythonBridgeBackend&, const py::object&) {});
  m.def("_make_dist_backend", [](int rank, int size, py::object impl) {
    return c10::make_intrusive<PythonBridgeBackend>(rank, size, std::move(impl));
  });
}

}  // namespace torch_pjrt
