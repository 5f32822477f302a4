// Python bindings: thin wrappers, all logic lives in the C++ layers.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include <atomic>
#include <map>
#include <mutex>

#include "aten/call_context.h"
#include "aten/collectives.h"
#include "aten/cpu_fallback.h"
#include "aten/device.h"
#include "aten/device_context.h"
#include "aten/executor.h"
#include "aten/exit_gate.h"
#include "aten/fused_graph.h"
#include "aten/host_restores.h"
#include "aten/lowering.h"
#include "aten/op_call.h"
#include "aten/streams.h"
#include "bindings/dist_backend.h"
#include "bindings/interpreter_exit.h"
#include "bindings/python_location.h"
#include "graph/metrics.h"
#include "graph/settings.h"
#include "graph/source_location.h"
#include "pjrt/error.h"

namespace py = pybind11;
using namespace torch_pjrt;

namespace {
struct ReplayHandle {  // opaque to Python: a compiled graph's replay plan
  std::shared_ptr<ReplayPlan> plan;
};
}  // namespace

namespace {

// The op's rule as Python sees it (torch_pjrt.op_traits): None if it has none. `name` is
// "aten::add_.Tensor", "add" or "mode.values"; `platform` defaults to the client's.
py::object op_traits(const std::string& name, std::optional<std::string> platform) {
  const lowering::OpRule* r = lowering::find_rule(lowering::base_name_of(name), lowering::overload_of(name),
                                                  platform ? *platform : lowering::current_platform());
  if (!r) return py::none();
  py::dict d;
  d["lowering"] = static_cast<bool>(r->fn);
  d["platform"] = r->platform;
  d["user_lowering"] = !r->key_tag.empty();
  d["elementwise"] = r->elementwise;
  d["complex"] = r->complex;
  d["length_padding"] = r->length_padding ? py::cast(*r->length_padding) : py::none();
  d["bake_scalars"] = r->bake_scalars;
  d["extra_writes"] = r->extra_writes;
  d["runtime_floats"] = r->runtime_floats;
  py::list cpu;
  static const std::pair<uint32_t, const char*> cpu_names[] = {
      {lowering::kAlphaCheck, "alpha_check"},      {lowering::kIndexPutValues, "index_put_values"},
      {lowering::kHostIndices, "host_indices"},    {lowering::kLayerNormStats, "layer_norm_stats"},
      {lowering::kBatchNormStats, "batch_norm_stats"}, {lowering::kConvLayout, "conv_layout"},
      {lowering::kPool2dLayout, "pool2d_layout"},  {lowering::kPool3dLayout, "pool3d_layout"},
      {lowering::kKeepsOutShape, "keeps_out_shape"}, {lowering::kCudaDtypes, "cuda_dtypes"}};
  for (const auto& [bit, label] : cpu_names)
    if (r->cpu_rules & bit) cpu.append(label);
  d["cpu_rules"] = cpu;
  d["internal_overlap_ok"] = r->internal_overlap_ok;
  d["inputs_overlap_unchecked"] = r->inputs_overlap_unchecked;
  d["no_aliasing"] = r->no_aliasing;
  d["no_aliasing_with"] = r->no_aliasing_with;
  d["route"] = r->route == lowering::Route::KeepGeneric ? "keep_generic"
               : r->route == lowering::Route::ToLowering ? "to_lowering" : "default";
  d["skip_decomposition"] = r->skip_decomposition;
  return d;
}

// A lowering written in Python (torch_pjrt.register_lowering). `lower(args, outputs)` gets the op's
// Tensor arguments as (shape, dtype) or None and its outputs as (shape, dtype), registers a function
// with _register_external_function and returns its key. It runs when the op is planned for new types,
// on the calling thread (the GIL taken there, as a Python kernel takes it); the lowering itself, which
// a fused graph may run later under its lock, only looks the key up.
struct PythonLowering {
  py::object lower;  // never released: rules live as long as the process
  std::mutex mutex;
  std::map<std::string, std::string> keys;  // argument and output types -> the registered function's key
};

std::string types_signature(lowering::Context& c) {
  std::string sig;
  auto add = [&](ElementType e, const lowering::Dims& dims) {
    sig += std::to_string(static_cast<int>(e)) + "[";
    for (int64_t d : dims) sig += std::to_string(d) + ",";
    sig += "]";
  };
  for (const std::string& name : c.tensor_arguments()) {
    if (c.is_tensor(name)) add(c.tensor_element(name), c.tensor_dims(name));
    else sig += "-";
  }
  sig += "->";
  for (size_t i = 0; i < c.output_count(); ++i) add(c.output(i).element, c.output(i).dims);
  return sig;
}

void register_python_lowering(const std::string& name, py::object lower, const std::string& platform) {
  auto state = std::shared_ptr<PythonLowering>(new PythonLowering{std::move(lower), {}, {}}, [](PythonLowering*) {});
  const std::string base = lowering::base_name_of(name), overload = lowering::overload_of(name);
  const std::string key = overload.empty() ? base : base + "." + overload;
  lowering::OpRule rule;
  rule.platform = platform;
  // What the CPU kernel checks and how the op is routed stay the op's; the lowering's own traits do not
  // carry over (the JAX function is not known to be elementwise, to take padding or complex values).
  if (const lowering::OpRule* old = lowering::find_rule(base, overload, platform)) {
    rule.cpu_rules = old->cpu_rules;
    rule.internal_overlap_ok = old->internal_overlap_ok;
    rule.inputs_overlap_unchecked = old->inputs_overlap_unchecked;
    rule.no_aliasing = old->no_aliasing;
    rule.no_aliasing_with = old->no_aliasing_with;
    rule.route = old->route == lowering::Route::KeepGeneric ? lowering::Route::Default : old->route;
  }
  static std::atomic<int> serial{0};
  rule.key_tag = "#py" + std::to_string(++serial);
  rule.prepare = [state](lowering::Context& c) {
    // fn sees only the tensors: a call that sets another argument (alpha=2) runs on the CPU, never silently without it.
    if (auto others = c.non_default_arguments(); !others.empty())
      throw lowering::Unsupported("a lowering from register_lowering takes only tensors; this call sets '" + others[0] + "'");
    std::string sig = types_signature(c);
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (state->keys.count(sig)) return;
    }
    std::string key, error;
    {
      py::gil_scoped_acquire gil;
      try {
        py::list args, outs;
        for (const std::string& arg : c.tensor_arguments()) {
          if (!c.is_tensor(arg)) {
            args.append(py::none());
            continue;
          }
          args.append(py::make_tuple(c.tensor_dims(arg), scalar_type_of(c.tensor_element(arg))));
        }
        for (size_t i = 0; i < c.output_count(); ++i)
          outs.append(py::make_tuple(c.output(i).dims, scalar_type_of(c.output(i).element)));
        key = state->lower(args, outs).cast<std::string>();
      } catch (py::error_already_set& e) {
        error = e.what();  // raised below, without the GIL: the error holds Python objects
      }
    }
    if (!error.empty()) throw std::runtime_error(error);
    std::lock_guard<std::mutex> lock(state->mutex);
    state->keys.emplace(sig, key);
  };
  rule.fn = [state](lowering::Context& c) {
    std::string sig = types_signature(c);
    std::string key;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      auto it = state->keys.find(sig);
      if (it == state->keys.end()) throw lowering::Unsupported("register_lowering: not prepared for these types");
      key = it->second;
    }
    std::vector<lowering::Value> operands;
    for (const std::string& arg : c.tensor_arguments())
      if (c.is_tensor(arg)) operands.push_back(c.tensor(arg));
    return lowering::call_external(c, key, operands);
  };
  lowering::register_rule(key, std::move(rule));
  // An op that had no lowering may need the device's kernel now (in place of a decomposition's); a rule
  // for another platform than this process's is kept for nothing else.
  if (platform.empty() || platform == lowering::current_platform())
    register_lowered_kernels(lowering::find_rule(base, overload, platform));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  // Local to this module: a global translator would also catch the c10
  // errors of every torch binding (pybind11's registry is shared), turning
  // NotImplementedError, TypeError, ... into RuntimeError. c10 errors fall
  // through to torch's own translator, which keeps their Python types.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const torch_pjrt::pjrt::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  install_interpreter_exit_guard();
  m.def("_begin_interpreter_exit", &begin_interpreter_exit);
  m.def("_configure_plugin", &configure_plugin);
  m.def("_configure_unavailable", &configure_unavailable);
  m.def("_compile_cache_dir", &compile_cache_dir);
  // The TORCH_PJRT_* settings (graph/settings.h): the table, and typed reads that raise naming the variable.
  m.def("_settings", [] {
    py::list rows;
    for (const auto& s : graph::settings::all())
      rows.append(py::make_tuple(s.name, s.default_value, s.what, graph::settings::raw(s.name)));
    return rows;
  });
  m.def("_setting_text", &graph::settings::text);
  m.def("_setting_flag", &graph::settings::flag);
  m.def("_setting_integer", [](const std::string& name, int64_t minimum) { return graph::settings::integer(name, minimum); });
  register_dist_backend_bindings(m);
  m.def("_register_lowered_kernels", [] { register_lowered_kernels(); });
  m.def("_note_cpu_fallback", &note_cpu_fallback);
  m.def("_plugin_path", &plugin_path);
  m.def("_runtime_started", &runtime_started);
  m.def("_is_in_bad_fork", &in_bad_fork);
  m.def("_check_not_forked", &check_not_forked);
  m.def("_device_count", &device_count);
  m.def("_current_device", &current_device);
  m.def("_set_device", &set_current_device);
  // Waiting for the device or a graph never holds the GIL: threads recording
  // ops take it to note their source line.
  // ExitGate after the release: it may park the thread at exit before the GIL is taken back.
  using release_gil = py::call_guard<py::gil_scoped_release, ExitGate>;
  // -1: every device (torch_pjrt.sync's and the test harness's meaning).
  m.def("_synchronize", [](int device) { device < 0 ? synchronize() : synchronize(device); }, py::arg("device") = -1,
        release_gil());
  m.def("_platform", [] {
    auto& c = client();
    return py::dict(py::arg("name") = c.platform_name(), py::arg("version") = c.platform_version(),
                    py::arg("device_kind") = c.device_kind(0),
                    py::arg("api_version") = std::to_string(c.plugin()->api_major()) + "." +
                                             std::to_string(c.plugin()->api_minor()));
  });
  // The plugin's memory statistics of a device; None where it reports none (the CPU plugin).
  m.def("_device_memory_stats", [](int device) -> py::object {
    check_device_index(device);
    auto stats = client().memory_stats(static_cast<size_t>(device));
    if (!stats) return py::none();
    return py::dict(py::arg("bytes_in_use") = stats->bytes_in_use, py::arg("peak_bytes_in_use") = stats->peak_bytes_in_use,
                    py::arg("bytes_limit") = stats->bytes_limit);
  });
  m.def("_memory_info", [](int device) { return memory_info(device); });  // (free, total) bytes
  m.def("_check_device_index", &check_device_index);
  m.def("_stream_priority", [](int64_t id) {
    stream_bit(id);  // checks it
    return stream_priority(id);
  });
  m.def("_device_kind", [](int device) {
    check_device_index(device);
    return client().device_kind(static_cast<size_t>(device));
  });
  // A switch of the calling thread's mode runs what was recorded first: a recorded graph runs under the mode
  // that recorded it. No switch while a device captures (a capture records in fused mode).
  static const std::map<std::string, Mode> modes{
      {"debug", Mode::Debug}, {"strict", Mode::Strict}, {"fused", Mode::Fused}, {"lazy", Mode::Lazy}};
  static auto parse_mode = [](const std::string& name) {
    auto it = modes.find(name);
    TORCH_CHECK(it != modes.end(), "unknown torch_pjrt mode '", name, "': expected debug, strict, fused or lazy");
    return it->second;
  };
  static auto mode_name = [](Mode m) -> std::string {
    switch (m) {
      case Mode::Debug: return "debug";
      case Mode::Strict: return "strict";
      case Mode::Fused: return "fused";
      case Mode::Lazy: return "lazy";
    }
    return "strict";
  };
  static auto check_not_capturing = [](const std::string& name) {
    if (runtime_started())
      for (DeviceContext* ctx : started_device_contexts())
        TORCH_CHECK(!capturing(ctx->index), "cannot switch to ", name, " mode while tpu:", ctx->index,
                    " is capturing a graph (torch.accelerator.Graph): a capture records in fused mode; set the mode "
                    "before the capture");
  };
  // The process's mode (every thread without a mode of its own).
  m.def("_set_mode", [](const std::string& name) {
    Mode to = parse_mode(name);
    if (to != process_mode()) check_not_capturing(name);
    flush_pending();
    set_mode(to);
  }, release_gil());
  // The calling thread's mode: its own, else the process's.
  m.def("_get_mode", [] { return mode_name(mode()); });
  m.def("_get_process_mode", [] { return mode_name(process_mode()); });
  // Gives the calling thread a mode of its own (None: the process's again); returns the previous own mode.
  // Twice per compiled call: the GIL is let go only when there is device work (a switch to run what was recorded).
  m.def("_set_thread_mode", [](std::optional<std::string> name) -> std::optional<std::string> {
    std::optional<Mode> to = name ? std::optional<Mode>(parse_mode(*name)) : std::nullopt;
    Mode effective = to ? *to : process_mode();
    if (effective != mode()) {
      py::gil_scoped_release nogil;
      ExitGate gate;
      check_not_capturing(mode_name(effective));
      flush_pending();
    }
    std::optional<Mode> previous = set_thread_mode(to);
    if (!previous) return std::nullopt;
    return mode_name(*previous);
  });
  m.def("_sync", [] { cut_pending(); }, release_gil());
  m.def("_cut_long", [] { cut_long_pending(); }, release_gil());
  m.def("_register_graph_impl", &register_graph_impl);
  m.def("_fail_capture", &fail_capture, release_gil());
  // Whether `device` (-1: any device) is capturing a graph (torch.accelerator.Graph).
  m.def("_capturing", [](int device) {
    if (!runtime_started() || in_bad_fork()) return false;
    if (device >= 0) return capturing(device);
    for (DeviceContext* ctx : started_device_contexts())
      if (capturing(ctx->index)) return true;
    return false;
  }, py::arg("device") = -1);
  m.def("_set_size_cuts", &set_size_cuts);
  py::class_<ReplayHandle>(m, "_ReplayPlan");
  m.def("_run_and_capture", [](const std::vector<at::Tensor>& inputs,
                               const std::vector<std::optional<at::Tensor>>& outputs) -> std::optional<ReplayHandle> {
    auto plan = run_and_capture(inputs, outputs);
    if (!plan) return std::nullopt;
    return ReplayHandle{std::move(plan)};
  }, release_gil());
  // torch_pjrt.export: the pending graph as a portable program, or None (_replay_refusal() says why).
  m.def("_export_program", [](const std::vector<at::Tensor>& inputs,
                              const std::vector<std::optional<at::Tensor>>& outputs) -> py::object {
    std::optional<ExportedProgram> e;
    {
      py::gil_scoped_release release;
      e = export_program(inputs, outputs);
    }
    if (!e) return py::none();
    py::list operands, outputs_out;
    for (const auto& op : e->operands) {
      if (op.kind == ExportedProgram::Operand::Input)
        operands.append(py::make_tuple("input", op.input));
      else if (op.kind == ExportedProgram::Operand::Rng)
        operands.append(py::make_tuple("rng", op.rng_count));
      else
        operands.append(py::make_tuple("constant", scalar_type_of(op.type), op.dims, py::bytes(op.bytes)));
    }
    for (const auto& out : e->outputs) {
      if (out.kind == ExportedProgram::Output::None) {
        outputs_out.append(py::none());
        continue;
      }
      const char* kind = out.kind == ExportedProgram::Output::Result ? "result" : "input";
      outputs_out.append(py::make_tuple(kind, out.index, out.sizes, out.strides, out.offset));
    }
    return py::dict(py::arg("text") = e->text, py::arg("operands") = operands,
                    py::arg("checks") = e->checks ? 1 : 0, py::arg("outputs") = outputs_out);
  });
  m.def("_replay", [](const ReplayHandle& h, const std::vector<at::Tensor>& inputs) { return replay(*h.plan, inputs); },
        release_gil());
  // A compiled graph's call arguments as (tpu tensors, ints), or None if any is neither: done here
  // because a step's hundreds of arguments cost a tenth of a millisecond to sort in Python.
  m.def("_split_replay_args", [](const py::list& args) -> py::object {
    std::vector<at::Tensor> tensors;
    py::list ints;
    for (py::handle a : args) {
      if (THPVariable_Check(a.ptr())) {
        const at::Tensor& t = THPVariable_Unpack(a.ptr());
        if (t.device().type() != c10::DeviceType::PrivateUse1) return py::none();
        tensors.push_back(t);
      } else if (PyLong_CheckExact(a.ptr())) {
        ints.append(a);
      } else {
        return py::none();
      }
    }
    return py::make_tuple(py::cast(tensors), py::tuple(ints));
  });
  m.def("_replay_refusal", &replay_refusal, release_gil());
  m.def("_step_may_fail", &step_may_fail, release_gil());
  m.def("_set_keep_values_on_failed_checks", &set_keep_values_on_failed_checks);
  m.def("_restore_host_state_if_failed", &restore_host_state_if_failed, release_gil());
  m.def("_registered_restores", &registered_restores, release_gil());
  // fn(tokens) puts back the host state of failed steps (host_restores.h). Kept
  // for the process's life: C++ calls it from whichever thread raises.
  m.def("_set_host_restore_runner", [](py::function fn) {
    auto* held = new py::object(std::move(fn));
    set_host_restore_runner([held](const std::vector<int64_t>& tokens) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      try {
        (*held)(tokens);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("torch_pjrt: restoring host state after a failed step");
      }
    });
  });
  // Device `device`'s default generator as a torch.Generator (torch.tpu.default_generators): the object wraps the
  // context's generator, which lives as long as the process.
  m.def("_default_generator", [](int device) {
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(default_generator(device)));
  });
  m.def("_manual_seed", [](int device, uint64_t seed) {
    auto gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  });
  // The RNG state as (seed, offset); Python packs it into torch's 16-byte tensor.
  m.def("_rng_state", [](int device) {
    auto gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return std::make_pair(gen.current_seed(), gen.get_offset());
  });
  m.def("_set_rng_state", [](int device, uint64_t seed, uint64_t offset) {
    auto gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
    gen.set_offset(offset);
  });
  m.def("_memory_allocated", &memory_allocated);
  m.def("_pending_host_transfers", &pending_host_transfers);
  m.def("_max_memory_allocated", &max_memory_allocated);
  m.def("_reset_peak_memory", &reset_peak_memory);
  m.def("_lowered_ops", &lowering::lowered_op_names);
  m.def("_op_base_name", &lowering::base_name_of);
  m.def("_op_traits", &op_traits, py::arg("name"), py::arg("platform") = py::none());
  m.def("_register_lowering", &register_python_lowering, py::arg("name"), py::arg("lower"), py::arg("platform") = "");
  m.def("_register_external_function", &lowering::register_external_function, py::arg("key"), py::arg("symbol"),
        py::arg("definitions"), py::arg("unsupported") = "");
  m.def("_metrics", [] {
    const graph::Metrics s = graph::metrics_snapshot();
    py::dict d;
    d["compiles"] = s.compiles.get();
    d["compile_seconds"] = s.compile_seconds.get();
    d["compile_cache_hits"] = s.compile_cache_hits.get();
    d["failing_op_searches"] = s.failing_op_searches.get();
    d["disk_cache_hits"] = s.disk_cache_hits.get();
    d["disk_cache_misses"] = s.disk_cache_misses.get();
    d["disk_cache_writes"] = s.disk_cache_writes.get();
    d["disk_cache_corrupt"] = s.disk_cache_corrupt.get();
    d["disk_cache_evictions"] = s.disk_cache_evictions.get();
    d["disk_cache_load_seconds"] = s.disk_cache_load_seconds.get();
    // Loaded programs now (gauges, not reset): the cache's and the memory maps
    // they added, bounded by TORCH_PJRT_MAX_LOADED_PROGRAMS / _MAPS, and every
    // executable alive (running work holds unloaded ones until it finishes).
    bool started = runtime_started() && !in_bad_fork();
    auto limits = started ? compile_cache().limits() : graph::CompileCache::limits_from_env();
    d["programs_loaded"] = started ? compile_cache().loaded() : 0;
    d["program_maps"] = started ? compile_cache().loaded_maps() : 0;
    d["executables_alive"] = pjrt::LoadedExecutable::alive();
    d["max_loaded_programs"] = limits.programs;
    d["max_loaded_maps"] = limits.maps;
    d["programs_unloaded"] = s.programs_unloaded.get();
    d["programs_reloaded"] = s.programs_reloaded.get();
    d["graph_lowering_seconds"] = s.graph_lowering_seconds.get();
    d["op_cache_hits"] = s.op_cache_hits.get();
    d["op_cache_misses"] = s.op_cache_misses.get();
    d["executions"] = s.executions.get();
    d["fused_ops"] = s.fused_ops.get();
    d["graphs"] = s.graphs.get();
    d["graph_cache_hits"] = s.graph_cache_hits.get();
    d["compiled_replays"] = s.compiled_replays.get();
    d["graph_replays"] = s.graph_replays.get();
    d["donated_buffers"] = s.donated_buffers.get();
    d["donated_bytes"] = s.donated_bytes.get();
    d["check_status_reads"] = s.check_status_reads.get();
    d["host_to_device_bytes"] = s.host_to_device_bytes.get();
    d["collectives_in_xla"] = s.collectives_in_xla.get();
    d["collective_bytes"] = s.collective_bytes.get();
    d["device_to_host_bytes"] = s.device_to_host_bytes.get();
    d["device_to_device_bytes"] = s.device_to_device_bytes.get();
    d["cpu_fallbacks"] = s.cpu_fallbacks;
    d["lowered_ops"] = s.lowered_ops;
    d["recompile_reasons"] = s.recompile_reasons;
    pybind11::dict lines;  // op name -> the user lines that ran it on the CPU
    for (const auto& [op, locations] : s.cpu_fallback_lines) {
      pybind11::list described;
      for (uint32_t location : locations) described.append(graph::describe_source_location(location));
      lines[pybind11::str(op)] = described;
    }
    d["cpu_fallback_lines"] = lines;
    return d;
  });
  m.def("_reset_metrics", &graph::reset_metrics);
  m.def("_xla_collective", &run_collective, py::arg("kind"), py::arg("tensors"), py::arg("op") = "sum",
        py::arg("dim") = 0, py::arg("groups") = std::vector<std::vector<int64_t>>{},
        py::arg("pairs") = std::vector<std::pair<int64_t, int64_t>>{}, py::arg("root") = 0, release_gil());
  m.def("_install_location_hook", &install_python_location_hook);
  m.def("_set_generated_code_resolver", [](py::object resolver) { set_generated_code_resolver(resolver.ptr()); });
  m.def("_inject_compile_fault", &inject_compile_fault, py::arg("name"), py::arg("located") = false);
  m.def("_storage_buffer_address", [](const at::Tensor& t) {
    TORCH_CHECK(t.device().type() == kTpu, "_storage_buffer_address needs a tpu tensor, got one on ", t.device());
    flush_pending();
    return storage_buffer_address(storage_state(t.storage()));
  }, release_gil());
}
