// fused_novograd_: validation, then the two CPU span passes with each tensor's running norm
// blended between them, or the CUDA launcher (csrc/kernels/novograd.cu). part="norms" /
// "apply" run one pass each, with each tensor's reduction of its grads in tensor_reductions
// between them (FSDP2 combines them over the shards there: ampfuse.ops.dtensor). master_mode,
// param_ids and seed as for fused_adam_ (master_args.h): the first pass reads only the grads, so
// a bf16 mode changes the second pass alone, which reads and writes the param through it.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../ops.h"
#include "checks.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "master_args.h"
#include "optimizer_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kNovoGrad = "fused_novograd_";

struct NovoGradArgs {
  std::vector<kernels::TensorRef> params, grads, exp_avgs, norm_avgs;
  MasterArgs masters;
  kernels::NovoGradConfig config;
  kernels::StepScalars scalars;
  kernels::NovoGradPart part;
  double* tensor_reductions;  // [n] float64; null when not given (kBoth only)
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

kernels::NovoGradPart parse_part(c10::string_view part) {
  if (part == "both") return kernels::NovoGradPart::kBoth;
  if (part == "norms") return kernels::NovoGradPart::kNorms;
  if (part == "apply") return kernels::NovoGradPart::kApply;
  TORCH_CHECK(false, "ampfuse.", kNovoGrad, ": part='", std::string(part),
              "' is not one of 'both', 'norms', 'apply'.");
}

// apex's norm_type: 2 (L2) or 0 (the max, infinity norm); anything else is refused, as apex
// refuses it.
bool parse_norm_type(std::int64_t norm_type) {
  TORCH_CHECK(norm_type == 2 || norm_type == 0, "ampfuse.", kNovoGrad, ": norm_type=", norm_type,
              " is not supported; use 2 (the L2 norm) or 0 (the max norm), as "
              "apex.optimizers.FusedNovoGrad.");
  return norm_type == 0;
}

// tensor_reductions: what the first half leaves for the second (each tensor's sum of squares,
// or max |g|, of its unscaled grads), a contiguous float64 [n] tensor on the params' device;
// required by the halves, optional (an extra output) for kBoth.
double* reductions_ptr(const c10::optional<at::Tensor>& given_tensor, kernels::NovoGradPart part,
                       std::size_t n, const at::Device& device) {
  const bool given = given_tensor.has_value() && given_tensor->defined();
  TORCH_CHECK(given || part == kernels::NovoGradPart::kBoth, "ampfuse.", kNovoGrad,
              ": part='norms' and part='apply' pass each tensor's grad reduction through "
              "tensor_reductions; give a torch.float64 tensor of shape (",
              n, ",).");
  if (!given) return nullptr;
  const at::Tensor& t = *given_tensor;
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 1 &&
                  t.size(0) == static_cast<std::int64_t>(n) && t.is_contiguous() &&
                  t.device() == device,
              "ampfuse.", kNovoGrad,
              ": tensor_reductions must be a contiguous torch.float64 "
              "tensor of shape (",
              n, ",) on ", device, ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device(), ".");
  return t.data_ptr<double>();
}

// One running norm per param: a one-element float32 tensor on the params' device.
std::vector<kernels::TensorRef> norm_avg_refs(at::TensorList norm_avgs, at::TensorList params,
                                              const at::Device& device,
                                              std::vector<at::Tensor>& keep_alive) {
  TORCH_CHECK(norm_avgs.size() == params.size(), "ampfuse.", kNovoGrad, ": norm_avgs has ",
              norm_avgs.size(), " tensors but params has ", params.size(),
              "; pass one running grad norm (a one-element float32 tensor) per param.");
  std::vector<kernels::TensorRef> refs;
  refs.reserve(norm_avgs.size());
  for (std::size_t i = 0; i < norm_avgs.size(); ++i) {
    const ArgLabel label("norm_avgs", static_cast<std::int64_t>(i));
    check_scalar_tensor(kNovoGrad, norm_avgs[i], label, at::kFloat, device, "params");
    refs.push_back(tensor_ref(kNovoGrad, norm_avgs[i], label, /*mutated=*/true, keep_alive));
  }
  return refs;
}

// The CPU step from the checked arguments.
void novograd_cpu(const NovoGradArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const float grad_scale_value = a.scalars.grad_scale != nullptr ? *a.scalars.grad_scale : 1.0f;
  const kernels::NovoGradStep novograd_step =
      kernels::make_novograd_constants(a.config, *a.scalars.step, *a.scalars.lr, grad_scale_value);
  const std::vector<Span> spans = split_into_spans(a.params);
  const std::size_t n = a.params.size();
  // Each tensor's reduction, from its spans' reductions combined in span order: the same for
  // any number of threads (a max is exact in any order).
  std::vector<double> reductions(n, 0.0);
  if (a.part == kernels::NovoGradPart::kApply) {
    std::copy(a.tensor_reductions, a.tensor_reductions + n, reductions.begin());
  } else {
    std::vector<double> per_span(spans.size(), 0.0);
    for_each_span(spans, [&](std::size_t s) {
      const Span& span = spans[s];
      const kernels::TensorRef& grad = a.grads[span.tensor];
      per_span[s] =
          kernels::cpu::novograd_norm_span(element_ptr(grad, span.offset), grad.dtype, span.size,
                                           grad_scale_value, a.config.max_norm);
    });
    for (std::size_t s = 0; s < spans.size(); ++s) {
      double& r = reductions[spans[s].tensor];
      r = a.config.max_norm ? static_cast<double>(kernels::max_abs_step(
                                  static_cast<float>(r), static_cast<float>(per_span[s])))
                            : r + per_span[s];
    }
    if (a.tensor_reductions != nullptr) {
      std::copy(reductions.begin(), reductions.end(), a.tensor_reductions);
    }
    if (a.part == kernels::NovoGradPart::kNorms) return;  // the count advances in the second half
  }
  // Each tensor's new running norm (an empty tensor blends a reduction of 0, as on CUDA).
  std::vector<float> denominators(n);
  for (std::size_t i = 0; i < n; ++i) {
    float* avg = static_cast<float*>(a.norm_avgs[i].data);
    *avg = kernels::novograd_blend(*avg, reductions[i], novograd_step);
    denominators[i] = kernels::novograd_denominator(*avg, novograd_step);
  }
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    if (a.masters.is_bf16_mode()) {
      kernels::cpu::novograd_bf16_span(static_cast<std::uint16_t*>(element_ptr(param, span.offset)),
                                       a.masters.span(span, novograd_step.steps_taken),
                                       element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                                       optional_fp32_ptr(a.exp_avgs, span), span.size,
                                       novograd_step, denominators[span.tensor]);
      return;
    }
    kernels::cpu::novograd_apply_span(
        element_ptr(param, span.offset), param.dtype, element_ptr(grad, span.offset), grad.dtype,
        a.write_grads, optional_fp32_ptr(a.exp_avgs, span), optional_fp32_ptr(a.masters.list, span),
        span.size, novograd_step, denominators[span.tensor]);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void novograd_cuda(const NovoGradArgs& a, const at::Tensor& step) {
  check_cuda_step(kNovoGrad, step);
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::NovoGradStep>(step.device());
  // Scratch from torch's caching allocator: no host sync, and graph capture takes it from the
  // graph's pool. The second half alone reads no partials (its reductions are given).
  const std::int64_t chunks = a.part == kernels::NovoGradPart::kApply
                                  ? 0
                                  : kernels::cuda::novograd_scratch_chunks(a.params);
  const auto scratch = at::TensorOptions().device(step.device());
  at::Tensor chunk_partials = at::empty({chunks}, scratch.dtype(at::kFloat));
  at::Tensor chunk_owner = at::empty({chunks}, scratch.dtype(at::kInt));
  at::Tensor own_reductions;
  double* reductions = a.tensor_reductions;
  if (reductions == nullptr) {
    own_reductions =
        at::empty({static_cast<std::int64_t>(a.params.size())}, scratch.dtype(at::kDouble));
    reductions = own_reductions.data_ptr<double>();
  }
  kernels::cuda::novograd(a.params, a.grads, a.exp_avgs, a.norm_avgs, a.masters.list, a.config,
                          a.scalars, a.write_grads,
                          static_cast<kernels::NovoGradStep*>(constants.data_ptr()),
                          chunk_partials.data_ptr<float>(), chunk_owner.data_ptr<std::int32_t>(),
                          reductions, current_stream(step.device()), a.part, a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_novograd_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_novograd_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList norm_avgs, at::TensorList master_params, const at::Tensor& step,
                     const at::Tensor& lr, double beta1, double beta2, double eps,
                     double weight_decay, bool bias_correction, bool grad_averaging,
                     bool reg_inside_moment, std::int64_t norm_type, bool init_zero,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                     const c10::optional<at::Tensor>& tensor_reductions, c10::string_view part,
                     c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed) {
  check_moment_hyperparameters(kNovoGrad, beta1, beta2, eps);
  TORCH_CHECK(weight_decay >= 0.0, "ampfuse.", kNovoGrad, ": weight_decay must be >= 0, got ",
              weight_decay, ".");
  NovoGradArgs a;
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kNovoGrad, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  a.part = parse_part(part);
  const bool max_norm = parse_norm_type(norm_type);
  const c10::optional<at::Device> device = list_device(kNovoGrad, params, "params");
  const at::Device home = device.value_or(step.device());
  a.params = tensor_refs(kNovoGrad, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kNovoGrad, step, lr, grad_scale, found_inf, device);
  a.tensor_reductions = reductions_ptr(tensor_reductions, a.part, params.size(), home);
  // Only the second pass writes the grads back: the first reads them.
  a.write_grads =
      a.part != kernels::NovoGradPart::kNorms && writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kNovoGrad, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  a.exp_avgs = companion_refs(kNovoGrad, exp_avgs, "exp_avgs", dense, Access::kWrite,
                              /*fp32_only=*/true, /*optional=*/false, a.keep_alive);
  a.norm_avgs = norm_avg_refs(norm_avgs, dense, home, a.keep_alive);
  // Checked in every part, though kNorms does not read it: both halves of a step take the
  // same arguments.
  a.masters =
      master_args(kNovoGrad, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {
      beta1,    beta2,    eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment,
      max_norm, init_zero};
  if constexpr (kDevice == at::kCPU) {
    novograd_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    novograd_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_novograd_kernels() { return AMPFUSE_KERNELS(fused_novograd_); }

}  // namespace ampfuse::ops
