// Autocast for `tpu` (the AutocastPrivateUse1 key): the cast policy PyTorch
// applies on CUDA, built from the op lists and wrappers ATen exports for every
// backend (ATen/autocast_mode.h). Matrix products and convolutions run in the
// autocast dtype (their lowerings accumulate in f32), numerically sensitive
// ops in f32, and mixed-dtype ops in the widest input dtype. Every other op
// falls through to the tpu kernel unchanged.
//
// Also GradScaler's unscale step on tpu: the executor writes single tensors,
// not lists, so _amp_foreach_non_finite_check_and_unscale_ runs one lowered
// op per tensor (torch_pjrt::_amp_unscale_, lowerings/amp.cpp); fused mode
// records them all into the step's graph.
#include <ATen/Operators.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/norm.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>
#if __has_include(<ATen/core/Dimname.h>)  // named tensors: gone in torch 2.13
#include <ATen/core/Dimname.h>
#define TORCH_PJRT_HAS_DIMNAME 1
#endif

namespace torch_pjrt {
namespace {

// AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE spells these unqualified
// (DimnameList: torch <= 2.11's list still has norm.names_ScalarOpt_dim).
#ifdef TORCH_PJRT_HAS_DIMNAME
using at::DimnameList;
#endif
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// As on CUDA: binary_cross_entropy in f16 overflows, so autocast refuses it.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                       int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

void amp_unscale_meta(at::Tensor&, at::Tensor&, const at::Tensor&) {}

// The CPU kernel, for the executor's CPU fallback and its stand-in probes.
void amp_unscale_cpu(at::Tensor& self, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  at::_amp_foreach_non_finite_check_and_unscale_(at::TensorList(self), found_inf, inv_scale);
}

// The checks of the CPU and CUDA kernels that a per-tensor loop would miss.
void amp_foreach_non_finite_check_and_unscale(at::TensorList self, at::Tensor& found_inf,
                                              const at::Tensor& inv_scale) {
  TORCH_CHECK(inv_scale.numel() == 1, "inv_scale must be a 1-element tensor.");
  TORCH_CHECK(found_inf.numel() == 1, "found_inf must be a 1-element tensor.");
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "inv_scale must be a float tensor.");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "found_inf must be a float tensor.");
  static const auto unscale = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("torch_pjrt::_amp_unscale_", "")
                                  .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&)>();
  for (const at::Tensor& t : self) {
    TORCH_CHECK(t.device() == found_inf.device(), "_amp_foreach_non_finite_check_and_unscale_: all tensors must be on ",
                found_inf.device(), ", got one on ", t.device());
    TORCH_CHECK(at::isFloatingType(t.scalar_type()),
                "_amp_foreach_non_finite_check_and_unscale_: expected floating point tensors, got ", t.scalar_type());
    at::Tensor target = t;
    unscale.call(target, found_inf, inv_scale);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_pjrt, m) {
  m.def("_amp_unscale_(Tensor(a!) self, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
}
TORCH_LIBRARY_IMPL(torch_pjrt, Meta, m) { m.impl("_amp_unscale_", amp_unscale_meta); }
TORCH_LIBRARY_IMPL(torch_pjrt, CPU, m) { m.impl("_amp_unscale_", amp_unscale_cpu); }
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_amp_foreach_non_finite_check_and_unscale_", amp_foreach_non_finite_check_and_unscale);
  // PyTorch's generated out= kernel, as the CPU runs it (the lowered functional
  // op, then the new scale copied into `out`; growth_tracker is left as it
  // was): the executor would pair its two written tensors with the wrong returns.
  m.impl("_amp_update_scale.out", TORCH_FN(at::compositeexplicitautograd::_amp_update_scale_outf));
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(TPU_LOWER_PRECISION_FP)
#undef TPU_LOWER_PRECISION_FP

#define TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(TPU_FP32)
#undef TPU_FP32

#define TPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_FP32_SET_OPT_DTYPE)
#undef TPU_FP32_SET_OPT_DTYPE

  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)

#define TPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(TPU_PROMOTE)
#undef TPU_PROMOTE

  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace torch_pjrt
