// Fused optimizer steps: _fused_adam_, _fused_adamw_ and _fused_sgd_ (and
// their functional forms), with the CPU kernels' math (FusedAdamKernel.cpp,
// FusedSGDKernel.cpp). Each Tensor[] argument is one value per parameter; the
// lowering returns the written lists' new values in argument order
// (params, grads, then the state lists), which is also the functional form's
// return order. The learning rate is a runtime operand (a float, registered
// in runtime_floats, or a tensor), so an LR scheduler never recompiles.
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

std::vector<Value> items(Context& c, std::string_view name) {
  std::vector<Value> out;
  for (const auto& v : c.tensor_list(name)) {
    if (!v) throw Unsupported(std::string(name) + " holds an undefined tensor");
    out.push_back(*v);
  }
  return out;
}

// The CPU kernels check lengths, shapes and dtypes; calls they reject run
// there and raise their error.
void require_matching(const std::vector<Value>& params, const std::vector<Value>& list, std::string_view name) {
  if (list.size() != params.size()) throw Unsupported(std::string(name) + " has another length than params");
  for (size_t i = 0; i < list.size(); ++i)
    if (!(list[i].type == params[i].type)) throw Unsupported(std::string(name) + " differs from params in shape or dtype");
}

// A 0-d or one-element tensor as an f64 scalar.
Value scalar_of(Builder& b, const Value& t) {
  if (t.type.element_count() != 1) throw Unsupported("expected a one-element tensor");
  return b.convert(b.reshape(t, {}), ElementType::F64);
}

Value learning_rate(Context& c) {
  return c.is_tensor("lr") ? scalar_of(c.b, c.tensor("lr")) : c.scalar("lr", ElementType::F64);
}

// An f64 scalar as a `like`-shaped value of like's dtype (the CPU kernels
// round their double coefficients to the math type: scalar_t(x)).
Value splat(Builder& b, const Value& s, const Value& like) {
  return b.broadcast_in_dim(b.convert(s, like.element()), like.dims(), {});
}

struct AmpArgs {
  std::optional<Value> grad_scale;  // f64 scalar: grads are divided by it (and written back)
  std::optional<Value> skip;        // pred scalar: found_inf == 1, the step changes nothing
};

AmpArgs amp_args(Context& c) {
  AmpArgs a;
  if (c.has("grad_scale")) a.grad_scale = scalar_of(c.b, c.tensor("grad_scale"));
  if (c.has("found_inf"))
    a.skip = c.b.compare(scalar_of(c.b, c.tensor("found_inf")), c.b.constant(1.0, ElementType::F64), hlo::Compare::EQ);
  return a;
}

// found_inf == 1: every written tensor keeps its value (the CPU kernels return early).
void keep_if_skipped(Builder& b, const AmpArgs& amp, const std::vector<Value>& old, std::vector<Value>& out) {
  if (!amp.skip) return;
  for (size_t i = 0; i < out.size(); ++i) {
    Value o = b.convert(old[i], out[i].element());
    out[i] = b.select(b.broadcast_in_dim(*amp.skip, o.dims(), {}), o, out[i]);
  }
}

Value unscaled(Builder& b, const AmpArgs& amp, Value grad) {
  return amp.grad_scale ? b.binary("divide", grad, splat(b, *amp.grad_scale, grad)) : grad;
}

Value widened(Builder& b, const Value& x) { return b.convert(x, widen(x.element())); }

template <bool AdamW>
std::vector<Value> lower_fused_adam(Context& c) {
  if (c.has("out")) throw Unsupported("the out= form");
  Builder& b = c.b;
  std::vector<Value> params = items(c, "self"), grads = items(c, "grads"), exp_avgs = items(c, "exp_avgs"),
                     exp_avg_sqs = items(c, "exp_avg_sqs"), max_sqs = items(c, "max_exp_avg_sqs"),
                     steps = items(c, "state_steps");
  bool amsgrad = c.bool_arg("amsgrad"), maximize = c.bool_arg("maximize");
  require_matching(params, grads, "grads");
  require_matching(params, exp_avgs, "exp_avgs");
  require_matching(params, exp_avg_sqs, "exp_avg_sqs");
  if (amsgrad) require_matching(params, max_sqs, "max_exp_avg_sqs");
  if (steps.size() != params.size()) throw Unsupported("state_steps has another length than params");
  double beta1 = c.float_arg("beta1"), beta2 = c.float_arg("beta2"), weight_decay = c.float_arg("weight_decay"),
         eps = c.float_arg("eps");
  Value lr = learning_rate(c);
  AmpArgs amp = amp_args(c);
  auto f64 = [&](double v) { return b.constant(v, ElementType::F64); };
  size_t n = params.size();
  std::vector<Value> new_params, new_grads, new_avgs, new_sqs, new_max;
  for (size_t i = 0; i < n; ++i) {
    // Coefficients in double, as the CPU kernel computes them from the step count.
    Value step = scalar_of(b, steps[i]);
    Value bias1 = b.binary("subtract", f64(1), b.binary("power", f64(beta1), step));
    Value bias2 = b.binary("subtract", f64(1), b.binary("power", f64(beta2), step));
    Value step_size = b.binary("divide", lr, bias1);
    Value bias2_sqrt = b.unary("sqrt", bias2);

    Value p = widened(b, params[i]);
    Value g = unscaled(b, amp, widened(b, grads[i]));
    new_grads.push_back(g);
    if (maximize) g = b.unary("negate", g);
    if (weight_decay != 0) {
      if (AdamW)  // param *= 1 - lr * weight_decay
        p = b.binary("multiply", p, splat(b, b.binary("subtract", f64(1), b.binary("multiply", lr, f64(weight_decay))), p));
      else
        g = b.binary("add", g, b.binary("multiply", p, splat(b, f64(weight_decay), p)));
    }
    // exp_avg.lerp_(grad, 1 - beta1), in lerp's two forms as the CPU picks them.
    Value m = widened(b, exp_avgs[i]);
    double weight = 1 - beta1;
    Value diff = b.binary("subtract", g, m);
    m = std::abs(weight) < 0.5 ? b.binary("add", m, b.binary("multiply", splat(b, f64(weight), m), diff))
                               : b.binary("subtract", g, b.binary("multiply", diff, splat(b, f64(1 - weight), m)));
    Value v = widened(b, exp_avg_sqs[i]);
    v = b.binary("add", b.binary("multiply", v, splat(b, f64(beta2), v)),
                 b.binary("multiply", b.binary("multiply", splat(b, f64(1 - beta2), v), g), g));
    Value second = v;
    if (amsgrad) {
      second = b.max(widened(b, max_sqs[i]), v);
      new_max.push_back(second);
    }
    Value denom = b.binary("add", b.binary("divide", b.unary("sqrt", second), splat(b, bias2_sqrt, second)),
                           splat(b, f64(eps), second));
    p = b.binary("subtract", p, b.binary("divide", b.binary("multiply", splat(b, step_size, m), m), denom));
    new_params.push_back(p);
    new_avgs.push_back(m);
    new_sqs.push_back(v);
  }
  // The in-place form writes grads only with a grad_scale (written_only_with): then, and in the functional
  // form, which returns them, the meta outputs count them.
  bool with_grads = c.output_count() > 3 * n + max_sqs.size();
  std::vector<Value> old, out;
  for (auto* list : {&params, &grads, &exp_avgs, &exp_avg_sqs})
    if (list != &grads || with_grads) old.insert(old.end(), list->begin(), list->end());
  for (auto* list : {&new_params, &new_grads, &new_avgs, &new_sqs})
    if (list != &new_grads || with_grads) out.insert(out.end(), list->begin(), list->end());
  if (amsgrad) {
    old.insert(old.end(), max_sqs.begin(), max_sqs.end());
    out.insert(out.end(), new_max.begin(), new_max.end());
  } else {
    old.insert(old.end(), max_sqs.begin(), max_sqs.end());  // written but unused: unchanged
    for (const Value& x : max_sqs) out.push_back(x);
  }
  keep_if_skipped(b, amp, old, out);
  return out;
}

std::vector<Value> lower_fused_sgd(Context& c) {
  if (c.has("out")) throw Unsupported("the out= form");
  Builder& b = c.b;
  std::vector<Value> params = items(c, "self"), grads = items(c, "grads"), bufs = items(c, "momentum_buffer_list");
  require_matching(params, grads, "grads");
  double weight_decay = c.float_arg("weight_decay"), momentum = c.float_arg("momentum"),
         dampening = c.float_arg("dampening");
  bool nesterov = c.bool_arg("nesterov"), maximize = c.bool_arg("maximize"), first = c.bool_arg("is_first_step");
  bool use_momentum = momentum != 0;
  if (use_momentum) require_matching(params, bufs, "momentum_buffer_list");
  Value lr = learning_rate(c);
  AmpArgs amp = amp_args(c);
  auto f64 = [&](double v) { return b.constant(v, ElementType::F64); };
  std::vector<Value> new_params, new_grads, new_bufs;
  for (size_t i = 0; i < params.size(); ++i) {
    Value p = widened(b, params[i]);
    Value g = unscaled(b, amp, widened(b, grads[i]));
    new_grads.push_back(g);
    if (maximize) g = b.unary("negate", g);
    if (weight_decay != 0) g = b.binary("add", g, b.binary("multiply", p, splat(b, f64(weight_decay), p)));
    if (use_momentum) {
      Value buf = first ? g
                        : b.binary("add", b.binary("multiply", widened(b, bufs[i]), splat(b, f64(momentum), g)),
                                   b.binary("multiply", splat(b, f64(1 - dampening), g), g));
      new_bufs.push_back(buf);
      g = nesterov ? b.binary("add", g, b.binary("multiply", splat(b, f64(momentum), g), buf)) : buf;
    }
    new_params.push_back(b.binary("subtract", p, b.binary("multiply", splat(b, lr, g), g)));
  }
  if (!use_momentum) new_bufs = bufs;  // written but unused: unchanged
  bool with_grads = c.output_count() > params.size() + bufs.size();  // as in lower_fused_adam
  std::vector<Value> old = params, out = new_params;
  if (with_grads) {
    old.insert(old.end(), grads.begin(), grads.end());
    out.insert(out.end(), new_grads.begin(), new_grads.end());
  }
  old.insert(old.end(), bufs.begin(), bufs.end());
  out.insert(out.end(), new_bufs.begin(), new_bufs.end());
  keep_if_skipped(b, amp, old, out);
  return out;
}

}  // namespace

void register_optim(Table& t) {
  // The CPU kernels write grads back only when they unscale them.
  add_lowering(t, "_fused_adam", lower_fused_adam<false>, false, {}, {"lr"}).written_only_with("grads", "grad_scale");
  add_lowering(t, "_fused_adamw", lower_fused_adam<true>, false, {}, {"lr"}).written_only_with("grads", "grad_scale");
  add_lowering(t, "_fused_sgd", lower_fused_sgd, false, {}, {"lr"}).written_only_with("grads", "grad_scale");
}

}  // namespace torch_pjrt::lowering
