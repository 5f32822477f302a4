// scaled_dot_product_attention's backend choice on tpu. Inference calls go to
// `_scaled_dot_product_fused_attention_overrideable`, one op lowered whole
// (lowerings/attention.cpp): it reads a KV cache grown by row cats padded to
// its capacity, so decoding with transformers' dynamic cache keeps one program
// per capacity bucket. Everything else takes PyTorch's math path (matmuls and
// a softmax), whose autograd PyTorch already provides.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/transformers/attention.h>

namespace torch_pjrt {
namespace {

constexpr int64_t kMath = 0, kOverrideable = 4;  // sdp::SDPBackend

bool on_device(const at::Tensor& t) {
  // Fake and functional tensors (torch.compile's tracing) keep the math path the compiled backend knows.
  return t.device().type() == c10::DeviceType::PrivateUse1 && !t.key_set().has(c10::DispatchKey::Python) &&
         !t.key_set().has(c10::DispatchKey::Functionalize);
}

int64_t sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, std::optional<double>,
                   bool enable_gqa) {
  const bool masked = mask && mask->defined();
  // torch.nn.attention.sdpa_kernel: a user who leaves the overrideable backend out gets the math path.
  if (!at::globalContext().userEnabledOverrideableSDP()) return kMath;
  for (const at::Tensor* t : {&q, &k, &v})
    if (!on_device(*t) || t->dim() != 4 || t->numel() == 0 || t->scalar_type() != q.scalar_type()) return kMath;
  if (!at::isFloatingType(q.scalar_type()) || dropout_p != 0.0 || (masked && is_causal)) return kMath;
  bool grad = q.requires_grad() || k.requires_grad() || v.requires_grad() || (masked && mask->requires_grad());
  if (grad && at::GradMode::is_enabled()) return kMath;
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  if (k.size(0) != batch || v.size(0) != batch || v.size(1) != kv_heads || k.size(2) != v.size(2) ||
      k.size(3) != q.size(3) || heads % kv_heads != 0 || (heads != kv_heads && !enable_gqa))
    return kMath;
  if (masked) {
    const at::Tensor& m = *mask;
    if (!on_device(m) || m.dim() > 4 || (m.scalar_type() != at::kBool && m.scalar_type() != q.scalar_type()))
      return kMath;
    const int64_t full[4] = {batch, heads, q.size(2), k.size(2)};
    for (int64_t d = 1; d <= m.dim(); ++d)
      if (m.size(-d) != 1 && m.size(-d) != full[4 - d]) return kMath;
  }
  return kOverrideable;
}

}  // namespace
}  // namespace torch_pjrt

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torch_pjrt::sdp_choice)
}
