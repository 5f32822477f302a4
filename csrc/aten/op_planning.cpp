// Planning: what an op call produces, decided once per key. PyTorch's meta kernel gives the outputs; the CPU
// check rules add what CPU kernels check or choose outside their meta kernels (memory overlap, alpha, index_put
// value shapes, norm statistics dtypes, channels_last layouts, in-place compute dtypes), and a probe runs the
// CPU kernel on stand-ins where a meta kernel may miss the CPU's error. Nothing here lowers or runs the op.
#include "aten/op_planning.h"
#include "aten/call_context.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/BinaryOps.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "aten/op_signature.h"

namespace torch_pjrt {

namespace {

// ---- meta inference -------------------------------------------------------

at::Tensor meta_like(const at::Tensor& t) {
  // Wrapped numbers (the `1` in `x + 1`) stay CPU scalars: meta kernels accept
  // them, and Python meta kernels turn them back into numbers.
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

c10::IValue meta_value(const c10::IValue& v) {
  // Factories name their device: on tpu the meta call would come back here.
  if (v.isDevice()) return c10::Device(at::kMeta);
  return map_tensors(v, meta_like);
}

std::vector<at::ScalarType> written_compute_dtypes(const Call& call, const std::vector<c10::IValue>& metas);
// PyTorch's meta kernels leave out some checks its CPU kernels make: on
// empty inputs (max() of an empty tensor, max(dim) over an empty dim) and on
// out= tensors of another dtype (bitwise_not(int, out=half), amax, tril). For
// such calls the CPU kernel runs once per signature on stand-ins of the same
// sizes and dtypes, so its error (type and message) is raised here.
bool meta_may_miss_an_error(const Call& call, int64_t* total) {
  bool any_empty = false, out_dtype_differs = false;
  std::set<at::ScalarType> input_dtypes;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto& v = call.args[i];
    if (v.isGenerator() && !v.isNone()) return false;
    bool written = is_written(call, static_cast<int>(i));
    map_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined()) return t;
      any_empty = any_empty || t.numel() == 0;
      *total += t.numel();
      if (!written && !t.unsafeGetTensorImpl()->is_wrapped_number()) input_dtypes.insert(t.scalar_type());
      return t;
    });
  }
  // out= (not in-place: self is not written) of a dtype no input has.
  if (call.returns_written && !call.schema.arguments().empty() && call.schema.arguments()[0].name() == "self" &&
      !is_written(call, 0)) {
    for (size_t k = 0; k < call.written.size(); ++k)
      out_dtype_differs = out_dtype_differs || !input_dtypes.count(written_tensor(call, call.args, k).scalar_type());
  }
  return any_empty || (out_dtype_differs && !input_dtypes.empty());
}
// The dtypes of the call's tensors (wrapped numbers aside); none if it draws
// from a generator (a probe would advance it).
std::optional<std::set<at::ScalarType>> tensor_dtypes(const Call& call) {
  std::set<at::ScalarType> dtypes;
  for (const auto& v : call.args) {
    if (v.isGenerator() && !v.isNone()) return std::nullopt;
    map_tensors(v, [&](const at::Tensor& t) {
      if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) dtypes.insert(t.scalar_type());
      return t;
    });
  }
  return dtypes;
}
void probe_on_cpu(const Call& call, bool only_dtype_errors = false);
void probe_on_cpu_with(const Call& call, bool only_dtype_errors, int fill);
void check_on_cpu_where_meta_may_not(const Call& call) {
  int64_t total = 0;
  bool may_miss = meta_may_miss_an_error(call, &total);
  if (may_miss && total <= (int64_t{1} << 22)) return probe_on_cpu(call);
  if (may_miss || total > (int64_t{1} << 20)) return;
  // Meta kernels do not check the dtypes a CPU kernel is built for (softmax,
  // gelu, avg_pool2d of integers), nor that it insists on one dtype where they
  // promote (torch.complex(float, double)): calls with integer or bool tensors,
  // or with tensors of several dtypes, probe the CPU kernel for that error only
  // (other errors of stand-ins are no verdict).
  auto dtypes = tensor_dtypes(call);
  if (!dtypes) return;
  bool integral = std::any_of(dtypes->begin(), dtypes->end(),
                              [](at::ScalarType t) { return at::isIntegralType(t, /*includeBool=*/true); });
  // Lowerings that follow CUDA for dtypes the CPU kernel lacks (histc of integers).
  if ((integral || dtypes->size() > 1) && !has_cpu_rule(call.schema, lowering::kCudaDtypes)) probe_on_cpu(call, true);
}

}  // namespace

// Runs the op's meta kernel: PyTorch's own shape, dtype and error checks.
MetaResult infer_meta(const Call& call) {
  torch::jit::Stack stack;
  std::vector<c10::IValue> metas;
  for (const auto& v : call.args) {
    metas.push_back(meta_value(v));
    stack.push_back(metas.back());
  }
  // Before the op's own meta kernel, whose out= cast check is laxer than CPU's.
  std::vector<at::ScalarType> compute = written_compute_dtypes(call, metas);
  try {
    call.op.callBoxed(&stack);
  } catch (const c10::NotImplementedError&) {
    // An op that only writes its arguments (_fused_sgd_ has no meta kernel)
    // needs none: its outputs are those arguments. Its lowering checks them.
    if (!call.schema.returns().empty() || call.written.empty()) throw;
    stack.clear();
  } catch (const std::exception&) {
    // Many meta kernels are Python references whose errors differ from the
    // CPU kernel's (type, message) or that reject what the CPU accepts.
    throw MetaRejected();
  }
  MetaResult r;
  auto add = [&](const at::Tensor& t) {
    r.outputs.push_back(OutputMeta{element_or_throw(t.scalar_type()), lowering::Dims(t.sizes().begin(), t.sizes().end())});
    r.dtypes.push_back(t.scalar_type());
    r.absent.push_back(false);
    bool keep = !t.is_contiguous() && t.is_non_overlapping_and_dense();
    r.strides.push_back(keep ? t.strides().vec() : std::vector<int64_t>());
  };
  if (call.returns_written) {
    for (size_t k = 0; k < call.written.size(); ++k) add(written_tensor(call, metas, k));
    for (size_t i = 0; i < call.written.size(); ++i) r.return_counts.push_back(1);
    // The lowering computes in the op's own result dtype; emit() casts to the written dtype.
    for (size_t i = 0; i < compute.size(); ++i) r.outputs[i].element = element_or_throw(compute[i]);
    return r;
  }
  for (const auto& v : stack) {
    if (v.isTensor() && v.toTensor().defined()) {
      add(v.toTensor());
      r.return_counts.push_back(1);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (const at::Tensor& t : list) add(t);
      r.return_counts.push_back(-static_cast<int>(list.size()) - 1);
    } else if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      // The lowering still yields a value here; the program leaves it out.
      r.outputs.push_back(OutputMeta{ElementType::F32, {}});
      r.dtypes.push_back(at::kFloat);
      r.absent.push_back(true);
      r.strides.emplace_back();
      r.return_counts.push_back(0);
    } else if (v.isInt()) {
      // A number the meta kernel derives from shapes (attention's max_q, max_k): fixed by the op's key.
      r.numbers.push_back(v.toInt());
      r.return_counts.push_back(kNumberReturn);
    } else {
      throw lowering::Unsupported("returns a non-tensor value");
    }
  }
  // Written arguments follow the returns: the lowering yields their new values.
  for (size_t k = 0; k < call.written.size(); ++k) add(written_tensor(call, metas, k));
  return r;
}

// ---- CPU checks the meta kernels miss ----------------------------------------

// Memory overlap, with ATen's own rules as the CPU kernels apply them
// (TensorIterator and the index family). tpu data pointers are storage + offset,
// so these metadata checks see what they see on the CPU.
void check_memory_overlap(const Call& call) {
  // The op's rule says what its CPU kernel checks (OpRule's overlap fields); no rule: TensorIterator's checks.
  static const lowering::OpRule none;
  const lowering::OpRule& rule = schema_facts(call.schema).rule ? *schema_facts(call.schema).rule : none;
  const auto& only = rule.no_aliasing_with;
  for (size_t k = 0; k < call.written.size(); ++k) {
    int w = call.written[k];
    const at::Tensor out = written_tensor(call, call.args, k);
    if (!rule.internal_overlap_ok) at::assert_no_internal_overlap(out);
    if (rule.inputs_overlap_unchecked) continue;
    for (size_t i = 0; i < call.args.size(); ++i) {
      if (static_cast<int>(i) == w) continue;
      map_tensors(call.args[i], [&](const at::Tensor& in) {
        if (!in.defined() || in.device().type() != kTpu) return in;
        if (rule.no_aliasing || std::find(only.begin(), only.end(), call.schema.arguments()[i].name()) != only.end())
          at::assert_no_overlap(out, in);
        else
          at::assert_no_partial_overlap(out, in);
        return in;
      });
    }
  }
}

namespace {

// The CPU kernel checks the value broadcasts to the indexing result; the meta
// kernel does not (a mismatch would fail compiling the lowering instead).
void check_index_put_value_shape(const Call& call, const at::Tensor& self, const at::Tensor& values) {
  const auto& indices = call.args[*call.schema.argumentIndexWithName("indices")];
  bool by_mask = false;  // boolean masks select data-dependent counts: the kernel checks those
  map_tensors(indices, [&](const at::Tensor& t) {
    by_mask = by_mask || (t.defined() && (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte));
    return t;
  });
  if (by_mask) return;
  auto meta_indices = meta_value(indices).to<c10::List<std::optional<at::Tensor>>>();
  at::Tensor result;
  try {
    result = at::index(at::empty(self.sizes(), self.options().device(at::kMeta)), meta_indices);
  } catch (const std::exception&) {
    throw MetaRejected();  // indices that do not broadcast: the CPU kernel raises its own IndexError
  }
  TORCH_CHECK(at::is_expandable_to(values.sizes(), result.sizes()), "shape mismatch: value tensor of shape ",
              values.sizes(), " cannot be broadcast to indexing result of shape ", result.sizes());
}

// Checks CPU kernels make in their bodies, outside the meta functions.
void check_cpu_kernel_rules(const Call& call) {
  auto alpha = call.schema.argumentIndexWithName("alpha");
  if (alpha && has_cpu_rule(call.schema, lowering::kAlphaCheck) && call.args[*alpha].isScalar()) {
    // The references accept a float alpha with bool tensors; BinaryOps' alpha_check does not.
    const auto& self = call.args[*call.schema.argumentIndexWithName("self")];
    const auto& other = call.args[*call.schema.argumentIndexWithName("other")];
    at::ScalarType common = other.isTensor() ? at::result_type(self.toTensor(), other.toTensor())
                                             : at::result_type(self.toTensor(), other.toScalar());
    at::native::alpha_check(common, call.args[*alpha].toScalar());
  }
  if (has_cpu_rule(call.schema, lowering::kIndexPutValues)) {
    auto self = call.args[*call.schema.argumentIndexWithName("self")].toTensor();
    auto values = call.args[*call.schema.argumentIndexWithName("values")].toTensor();
    // In the CPU kernel's order (make_index_put_iterator): indices, value shape, then dtype.
    check_index_put_value_shape(call, self, values);
    TORCH_CHECK(values.scalar_type() == self.scalar_type(),
                "Index put requires the source and destination dtypes match, got ", self.scalar_type(),
                " for the destination and ", values.scalar_type(), " for the source.");
  }
}

// Saved statistics of CPU's layer and batch norms: the meta kernels (modelled
// on CUDA) say float32 for half inputs; the CPU kernels save them in the
// parameters' dtype (float32 only when a weight, bias or running stat is), and
// batch norm in eval mode saves none (empty tensors).
void apply_cpu_norm_stats_rules(const Call& call, MetaResult& meta) {
  bool layer = has_cpu_rule(call.schema, lowering::kLayerNormStats);
  bool batch = has_cpu_rule(call.schema, lowering::kBatchNormStats);
  if ((!layer && !batch) || meta.outputs.size() < 3) return;
  at::ScalarType input = call.args[*call.schema.argumentIndexWithName("input")].toTensor().scalar_type();
  at::ScalarType stats = input;
  for (const char* name : {"weight", "bias", "running_mean", "running_var"}) {
    auto i = call.schema.argumentIndexWithName(name);
    if (i && call.args[*i].isTensor() && call.args[*i].toTensor().scalar_type() == at::kFloat) stats = at::kFloat;
  }
  bool eval_with_running = batch && !call.args[*call.schema.argumentIndexWithName("training")].toBool() &&
                           call.args[*call.schema.argumentIndexWithName("running_mean")].isTensor() &&
                           call.args[*call.schema.argumentIndexWithName("running_var")].isTensor();
  for (size_t i : {1, 2}) {
    if (input == at::kHalf || input == at::kBFloat16) {
      meta.dtypes[i] = stats;
      meta.outputs[i].element = element_or_throw(stats);
    }
    if (eval_with_running) {
      meta.outputs[i].dims = {0};
      meta.strides[i] = {};
    }
  }
}

// Output layouts CPU kernels choose where the meta kernels say row-major:
// convolutions (and their gradients) run channels_last when the input or the
// weight is (3-d convolutions in float64 have no channels_last kernel).
void apply_cpu_layout_rules(const Call& call, MetaResult& meta) {
  // Pooling kernels (and their gradients) follow the input's suggested memory format.
  bool pool3d = has_cpu_rule(call.schema, lowering::kPool3dLayout);
  bool pool = pool3d || has_cpu_rule(call.schema, lowering::kPool2dLayout);
  if (!has_cpu_rule(call.schema, lowering::kConvLayout) && !pool) return;
  auto input = call.args[*call.schema.argumentIndexWithName(pool ? "self" : "input")].toTensor();
  // 3-d pools see an unbatched (C, D, H, W) input as a batch of one.
  bool unbatched = pool3d && input.dim() == 4;
  if (unbatched) input = input.unsqueeze(0);
  auto weight = pool ? input : call.args[*call.schema.argumentIndexWithName("weight")].toTensor();
  auto suggests = [&](c10::MemoryFormat f) {
    return input.suggest_memory_format() == f || weight.suggest_memory_format() == f;
  };
  bool cl2 = input.dim() == 4 && suggests(c10::MemoryFormat::ChannelsLast);
  bool cl3 = input.dim() == 5 && suggests(c10::MemoryFormat::ChannelsLast3d) && (pool || input.scalar_type() != at::kDouble);
  // (the batch of one's stride defeats suggest_memory_format; CPU's kernel asks is_contiguous)
  cl3 = cl3 || (unbatched && input.is_contiguous(c10::MemoryFormat::ChannelsLast3d));
  if (!cl2 && !cl3) return;
  for (size_t i = 0; i < meta.outputs.size(); ++i) {
    lowering::Dims dims = meta.outputs[i].dims;
    if (unbatched) dims.insert(dims.begin(), 1);
    if (meta.absent[i] || static_cast<int64_t>(dims.size()) != input.dim()) continue;
    std::vector<int64_t> strides = cl2 ? c10::get_channels_last_strides_2d(dims) : c10::get_channels_last_strides_3d(dims);
    if (unbatched) {
      dims.erase(dims.begin());
      strides.erase(strides.begin());
    }
    bool row_major = at::empty_strided(dims, strides, at::TensorOptions().device(at::kMeta)).is_contiguous();
    meta.strides[i] = row_major ? std::vector<int64_t>() : strides;
  }
}

// The functional form of an in-place or out= op (add_.Tensor, add.out ->
// add.Tensor): the overload of the base name whose arguments are the op's
// own minus the written out= ones. Its result dtype is what CPU computes in.
std::optional<c10::OperatorHandle> functional_form(const c10::FunctionSchema& schema) {
  static std::mutex mutex;
  static auto& found = *new std::unordered_map<std::string, std::optional<c10::OperatorHandle>>();
  static auto& overloads = *new std::unordered_map<std::string, std::vector<c10::OperatorName>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::string key = op_name(schema);
  if (auto it = found.find(key); it != found.end()) return it->second;
  auto& dispatcher = c10::Dispatcher::singleton();
  if (overloads.empty())
    for (const c10::OperatorName& n : dispatcher.getAllOpNames()) overloads[n.name].push_back(n);
  std::vector<const c10::Argument*> wanted;
  for (const auto& a : schema.arguments())
    if (!(a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite())) wanted.push_back(&a);
  const std::string& base = base_name(schema);  // aten's names come without their namespace
  std::string name = base.find("::") == std::string::npos ? "aten::" + base : base;
  std::optional<c10::OperatorHandle> result;
  for (const c10::OperatorName& n : overloads[name]) {
    auto op = dispatcher.findOp(n);
    if (!op || !op->hasSchema() || op_name(op->schema()) == key || !op->schema().returns().size()) continue;
    const auto& args = op->schema().arguments();
    bool same = args.size() == wanted.size();
    for (size_t i = 0; same && i < args.size(); ++i)
      same = args[i].name() == wanted[i]->name() && args[i].type()->str() == wanted[i]->type()->str() &&
             !(args[i].alias_info() && args[i].alias_info()->isWrite());
    if (same) {
      result = op;
      break;
    }
  }
  found.emplace(key, result);
  return result;
}

// Runs the op's CPU kernel once on stand-ins of the same sizes and dtypes, so
// a check CPU makes outside the meta kernels raises CPU's own error (type and
// message). Stand-ins are ones (valid divisors; read-only inputs are expanded
// scalars, so no memory) and zeros for index arguments (valid for any size).
void probe_on_cpu(const Call& call, bool only_dtype_errors) { probe_on_cpu_with(call, only_dtype_errors, 1); }
void probe_on_cpu_with(const Call& call, bool only_dtype_errors, int fill) {
  torch::jit::Stack stack;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto& v = call.args[i];
    if (v.isDevice()) {
      stack.push_back(c10::Device(at::kCPU));
      continue;
    }
    bool written = is_written(call, static_cast<int>(i));
    bool index = call.schema.arguments()[i].name().find("ind") != std::string::npos;
    stack.push_back(map_tensors(v, [&](const at::Tensor& t) {
      if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
      auto options = t.options().device(at::kCPU);
      at::Tensor one = index || fill == 0 ? at::zeros({}, options) : at::ones({}, options);
      // Dense tensors keep their strides (kernels such as _grouped_mm check
      // them); other views read an expanded scalar, which costs no memory.
      if (t.is_non_overlapping_and_dense()) return at::empty_strided(t.sizes(), t.strides(), options).copy_(one);
      return written ? one.expand(t.sizes()).clone() : one.expand(t.sizes());
    }));
  }
  try {
    call.op.callBoxed(&stack);
  } catch (const c10::NotImplementedError& e) {
    // No CPU kernel to ask: the meta kernel's checks are all there are. (A
    // kernel without this dtype raises as the CPU does.)
    if (std::string(e.what()).find("Could not run") == std::string::npos) throw;
  } catch (const std::exception& e) {
    if (!only_dtype_errors || fill == 0) throw;
    // Stand-in values may cause an error real data would not; one that ones
    // and zeros both raise with the same message is about the dtypes or
    // shapes ("Boolean inputs not supported for relu"): the CPU raises it.
    auto message = [](const std::exception& x) -> std::string {
      auto* c10_error = dynamic_cast<const c10::Error*>(&x);
      return c10_error ? c10_error->what_without_backtrace() : x.what();
    };
    std::string first = message(e);
    try {
      probe_on_cpu_with(call, false, 0);
    } catch (const std::exception& again) {
      if (first == message(again)) throw;
    }
  }
}

// In-place and out= ops compute in their functional form's result dtype and
// cast to the written tensor's dtype where CPU allows that cast. Returns the
// compute dtype per written tensor (in call.written order).
std::vector<at::ScalarType> written_compute_dtypes(const Call& call, const std::vector<c10::IValue>& metas) {
  std::vector<at::ScalarType> out;
  for (size_t k = 0; k < call.written.size(); ++k) out.push_back(written_tensor(call, metas, k).scalar_type());
  if (!call.returns_written) return out;
  auto functional = functional_form(call.schema);
  if (!functional) return out;
  torch::jit::Stack stack;
  const auto& args = call.schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (!(args[i].kwarg_only() && args[i].alias_info() && args[i].alias_info()->isWrite()))
      stack.push_back(meta_value(call.args[i]));
  try {
    functional->callBoxed(&stack);
  } catch (const c10::NotImplementedError&) {
    return out;  // no usable functional meta: the written dtype stays the compute dtype
  } catch (const std::exception&) {
    throw MetaRejected();
  }
  if (stack.size() != out.size()) return out;
  bool probe = false;
  for (size_t k = 0; k < out.size(); ++k) {
    if (!stack[k].isTensor()) return out;
    at::ScalarType result = stack[k].toTensor().scalar_type();
    if (result == out[k]) continue;
    TORCH_CHECK(c10::canCast(result, out[k]), "result type ", result, " can't be cast to the desired output type ",
                out[k]);
    probe = true;
    out[k] = result;
  }
  if (probe) probe_on_cpu(call);
  return out;
}

// The 1-d factories' CPU kernels resize their out= tensor only when its element count differs
// (arange_out, range_out, linspace_out, logspace_out); otherwise the values fill it in its own shape,
// row-major, whatever its strides (od.t(), od[::2]). The meta kernels resize it to 1-d.
bool keeps_out_shape(const Call& call, const OutputPlan& p) {
  if (!has_cpu_rule(call.schema, lowering::kKeepsOutShape)) return false;
  at::Tensor out = item_tensor(call.args[p.arg], p.item);
  return !out.sizes().equals(p.dims) && out.numel() == c10::multiply_integers(p.dims);
}

}  // namespace

// The op's plan: PyTorch's meta kernel decides output shapes and dtypes.
std::shared_ptr<CachedOp> plan(Call& call, const lowering::LoweringEntry& entry) {
  check_memory_overlap(call);
  check_cpu_kernel_rules(call);
  auto cached = std::make_shared<CachedOp>();
  check_on_cpu_where_meta_may_not(call);
  cached->meta = infer_meta(call);
  cached->float32_precision = float32_precision();
  apply_cpu_layout_rules(call, cached->meta);
  apply_cpu_norm_stats_rules(call, cached->meta);
  cached->entry = &entry;
  if (entry.prepare) prepare_rule(call, *cached);  // a lowering written in Python readies itself for these types
  // A lowering that does not declare complex support never computes a complex
  // result (real inputs, complex outputs: _to_copy, a factory with a dtype).
  for (const OutputMeta& o : cached->meta.outputs)
    if (is_complex(o.element) && !entry.complex) cached->unsupported = "no complex lowering";
  const MetaResult& meta = cached->meta;
  cached->return_counts = meta.return_counts;
  cached->cat = op_name(call.schema) == "aten::cat";
  size_t first_written = meta.outputs.size() - call.written.size();
  for (size_t i = 0; i < meta.outputs.size(); ++i) {
    OutputPlan p;
    p.absent = meta.absent[i];
    p.write = i >= first_written;
    p.arg = p.write ? call.written[i - first_written] : 0;
    p.item = p.write ? call.written_items[i - first_written] : -1;
    p.dtype = meta.dtypes[i];
    p.dims = meta.outputs[i].dims;
    if (p.write && keeps_out_shape(call, p)) p.dims = item_tensor(call.args[p.arg], p.item).sizes().vec();
    if (!p.write) p.strides = meta.strides[i];
    cached->outputs.push_back(p);
  }
  // An op with no outputs at all (_assert_async) still runs: its runtime checks are its result.
  cached->outputs_empty = !cached->outputs.empty();
  for (const OutputPlan& p : cached->outputs)
    if (!p.absent && c10::multiply_integers(p.dims) != 0) cached->outputs_empty = false;
  return cached;
}

// Index tensors held on the host (`x[cpu_indices]`) are checked at the op,
// with the CPU's error; indices on the device are checked by the program,
// whose verdict surfaces at the next wait (Runtime checks, architecture.md).
void check_host_indices(const Call& call) {
  if (!has_cpu_rule(call.schema, lowering::kHostIndices)) return;
  const auto& list = call.args[*call.schema.argumentIndexWithName("indices")];
  const at::Tensor& self = call.args[*call.schema.argumentIndexWithName("self")].toTensor();
  if (!list.isList()) return;
  auto items = list.toList();
  int64_t position = -1;  // CPU's message numbers the indexed dims only
  for (size_t d = 0; d < items.size() && static_cast<int64_t>(d) < self.dim(); ++d) {
    c10::IValue item = items.get(d);
    if (!item.isTensor() || !item.toTensor().defined()) continue;
    ++position;
    const at::Tensor& t = item.toTensor();
    if (!t.device().is_cpu() || t.numel() == 0 || !at::isIntegralType(t.scalar_type(), false)) continue;
    int64_t size = self.size(static_cast<int64_t>(d));
    at::Tensor flat = t.reshape(-1).to(at::kLong);
    at::Tensor bad = at::logical_or(flat < -size, flat >= size).nonzero();
    if (bad.numel() == 0) continue;
    TORCH_CHECK_INDEX(false, "index ", flat[bad[0][0].item<int64_t>()].item<int64_t>(), " is out of bounds for dimension ",
                      position, " with size ", size);
  }
}

}  // namespace torch_pjrt
