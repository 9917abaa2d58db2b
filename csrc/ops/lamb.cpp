// fused_lamb_: validation, then the two CPU span passes with the per-tensor trust ratios
// between them, or the CUDA launcher (csrc/kernels/lamb.cu). part="moments" / "apply" run one
// pass each, with the per-tensor sums in tensor_sums between them (FSDP2 adds them over the
// shards there: ampfuse.ops.dtensor). master_mode, param_ids and seed as for fused_adam_
// (master_args.h): in a bf16 mode both passes read the value the mode holds.
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
#include "lamb_args.h"
#include "master_args.h"
#include "optimizer_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kLamb = "fused_lamb_";

struct LambArgs {
  std::vector<kernels::TensorRef> params, grads, exp_avgs, exp_avg_sqs;
  MasterArgs masters;
  kernels::LambConfig config;
  kernels::StepScalars scalars;
  const float* grad_norm;  // null without clipping (and for kApply)
  kernels::LambPart part;
  double* tensor_sums;  // [n, 2] float64, null when not asked for (kBoth only)
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// The CPU step from the checked arguments.
void lamb_cpu(const LambArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const float grad_scale_value = a.scalars.grad_scale != nullptr ? *a.scalars.grad_scale : 1.0f;
  const kernels::LambStep lamb_step =
      kernels::make_lamb_constants(a.config, *a.scalars.step, *a.scalars.lr, grad_scale_value,
                                   a.grad_norm != nullptr ? *a.grad_norm : 0.0f);
  const std::vector<Span> spans = split_into_spans(a.params);
  const std::size_t n = a.params.size();
  // Each tensor's sums of squares of its param and of its update ([2i], [2i + 1]), from its
  // spans' sums added in span order: the same for any number of threads.
  std::vector<double> sums(2 * n, 0.0);
  if (a.part == kernels::LambPart::kApply) {
    std::copy(a.tensor_sums, a.tensor_sums + 2 * n, sums.begin());
  } else {
    // First pass: the moments, and each span's sums.
    std::vector<double> param_sq(spans.size(), 0.0), update_sq(spans.size(), 0.0);
    for_each_span(spans, [&](std::size_t s) {
      const Span& span = spans[s];
      const kernels::TensorRef& param = a.params[span.tensor];
      const kernels::TensorRef& grad = a.grads[span.tensor];
      if (a.masters.is_bf16_mode()) {
        kernels::cpu::lamb_moments_bf16_span(
            static_cast<const std::uint16_t*>(element_ptr(param, span.offset)),
            a.masters.span(span, lamb_step.steps_taken), element_ptr(grad, span.offset), grad.dtype,
            a.write_grads, optional_fp32_ptr(a.exp_avgs, span),
            optional_fp32_ptr(a.exp_avg_sqs, span), span.size, lamb_step, &param_sq[s],
            &update_sq[s]);
        return;
      }
      kernels::cpu::lamb_moments_span(
          element_ptr(param, span.offset), param.dtype, element_ptr(grad, span.offset), grad.dtype,
          a.write_grads, optional_fp32_ptr(a.exp_avgs, span),
          optional_fp32_ptr(a.exp_avg_sqs, span), optional_fp32_ptr(a.masters.list, span),
          span.size, lamb_step, &param_sq[s], &update_sq[s]);
    });
    for (std::size_t s = 0; s < spans.size(); ++s) {
      sums[2 * spans[s].tensor] += param_sq[s];
      sums[2 * spans[s].tensor + 1] += update_sq[s];
    }
    if (a.tensor_sums != nullptr) std::copy(sums.begin(), sums.end(), a.tensor_sums);
    if (a.part == kernels::LambPart::kMoments) {
      finish_copy_back(a.copy_back);
      return;  // the count advances in the second half
    }
  }
  std::vector<float> ratios(n);
  for (std::size_t i = 0; i < n; ++i) {
    ratios[i] = kernels::lamb_ratio(static_cast<float>(std::sqrt(sums[2 * i])),
                                    static_cast<float>(std::sqrt(sums[2 * i + 1])), lamb_step);
  }
  // Second pass: the params (and masters).
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    if (a.masters.is_bf16_mode()) {
      // The same steps_taken as the first pass: both passes read the same value, and the
      // stochastic bits are keyed as fused_adam_'s and fused_sgd_'s.
      kernels::cpu::lamb_apply_bf16_span(
          static_cast<std::uint16_t*>(element_ptr(param, span.offset)),
          a.masters.span(span, lamb_step.steps_taken), optional_fp32_ptr(a.exp_avgs, span),
          optional_fp32_ptr(a.exp_avg_sqs, span), span.size, lamb_step, ratios[span.tensor]);
      return;
    }
    kernels::cpu::lamb_apply_span(
        element_ptr(param, span.offset), param.dtype, optional_fp32_ptr(a.exp_avgs, span),
        optional_fp32_ptr(a.exp_avg_sqs, span), optional_fp32_ptr(a.masters.list, span), span.size,
        lamb_step, ratios[span.tensor]);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void lamb_cuda(const LambArgs& a, const at::Tensor& step) {
  check_cuda_step(kLamb, step);
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::LambStep>(step.device());
  // Scratch from torch's caching allocator: no host sync, and graph capture takes it from the
  // graph's pool. The second half alone reads no chunk sums (its sums are tensor_sums).
  const std::int64_t chunks =
      a.part == kernels::LambPart::kApply ? 0 : kernels::cuda::lamb_scratch_chunks(a.params);
  const auto scratch = at::TensorOptions().device(step.device());
  at::Tensor chunk_sums = at::empty({2 * chunks}, scratch.dtype(at::kFloat));
  at::Tensor chunk_owner = at::empty({chunks}, scratch.dtype(at::kInt));
  at::Tensor ratios =
      at::empty({static_cast<std::int64_t>(a.params.size())}, scratch.dtype(at::kFloat));
  kernels::cuda::lamb(
      a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.masters.list, a.config, a.scalars,
      a.grad_norm, a.write_grads, static_cast<kernels::LambStep*>(constants.data_ptr()),
      chunk_sums.data_ptr<float>(), chunk_owner.data_ptr<std::int32_t>(), ratios.data_ptr<float>(),
      current_stream(step.device()), a.part, a.tensor_sums, a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_lamb_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList master_params, const at::Tensor& step,
                 const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adam_w_mode, bool bias_correction, bool grad_averaging, bool use_nvlamb,
                 double max_grad_norm, const c10::optional<at::Tensor>& grad_norm,
                 const c10::optional<at::Tensor>& grad_scale,
                 const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                 const c10::optional<at::Tensor>& tensor_sums, c10::string_view part,
                 c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed) {
  check_lamb_hyperparameters(kLamb, beta1, beta2, eps, weight_decay, max_grad_norm);
  LambArgs a;
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kLamb, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  a.part = parse_lamb_part(kLamb, part);
  const bool has_norm = grad_norm.has_value() && grad_norm->defined();
  // The second half forms no clip: it needs no norm.
  TORCH_CHECK(max_grad_norm == 0.0 || has_norm || a.part == kernels::LambPart::kApply, "ampfuse.",
              kLamb, ": max_grad_norm=", max_grad_norm,
              " clips by the global grad norm; pass it as grad_norm (a "
              "one-element float32 tensor, e.g. ampfuse's multi_tensor_l2norm of every grad of "
              "the step), or max_grad_norm=0 for no clipping.");
  const c10::optional<at::Device> device = list_device(kLamb, params, "params");
  a.params = tensor_refs(kLamb, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kLamb, step, lr, grad_scale, found_inf, device);
  a.tensor_sums =
      lamb_sums_ptr(kLamb, tensor_sums, a.part, params.size(), device.value_or(step.device()));
  a.grad_norm = nullptr;
  if (max_grad_norm > 0.0 && a.part != kernels::LambPart::kApply) {
    check_scalar_tensor(kLamb, *grad_norm, "grad_norm", at::kFloat, device.value_or(step.device()),
                        device.has_value() ? "params" : "step, as params is empty");
    a.grad_norm = grad_norm->data_ptr<float>();
  }
  // Only the first pass reads (and may write back) the grads.
  a.write_grads =
      a.part != kernels::LambPart::kApply && writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kLamb, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  const auto state = [&](at::TensorList list, const char* name, bool optional) {
    return companion_refs(kLamb, list, name, dense, Access::kWrite, /*fp32_only=*/true, optional,
                          a.keep_alive);
  };
  a.exp_avgs = state(exp_avgs, "exp_avgs", false);
  a.exp_avg_sqs = state(exp_avg_sqs, "exp_avg_sqs", false);
  a.masters = master_args(kLamb, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {beta1,           beta2,          eps,       weight_decay, max_grad_norm, adam_w_mode,
              bias_correction, grad_averaging, use_nvlamb};
  if constexpr (kDevice == at::kCPU) {
    lamb_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    lamb_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_lamb_kernels() { return AMPFUSE_KERNELS(fused_lamb_); }

}  // namespace ampfuse::ops
