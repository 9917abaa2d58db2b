// fused_adam_: validation, then the CPU span kernel or the CUDA launcher
// (csrc/kernels/adam.cu).
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

constexpr const char* kAdam = "fused_adam_";

struct AdamArgs {
  std::vector<kernels::TensorRef> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  MasterArgs masters;
  kernels::AdamConfig config;
  kernels::StepScalars scalars;
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// The CPU step from the checked arguments.
void adam_cpu(const AdamArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const kernels::AdamStep adam_step = cpu_step_constants(a.config, a.scalars);
  const std::vector<Span> spans = split_into_spans(a.params);
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    if (a.masters.is_bf16_mode()) {
      kernels::cpu::adam_bf16_span(
          static_cast<std::uint16_t*>(element_ptr(param, span.offset)),
          a.masters.span(span, adam_step.steps_taken), element_ptr(grad, span.offset), grad.dtype,
          a.write_grads, optional_fp32_ptr(a.exp_avgs, span),
          optional_fp32_ptr(a.exp_avg_sqs, span), optional_fp32_ptr(a.max_exp_avg_sqs, span),
          span.size, adam_step);
      return;
    }
    kernels::cpu::adam_span(
        element_ptr(param, span.offset), param.dtype, element_ptr(grad, span.offset), grad.dtype,
        a.write_grads, optional_fp32_ptr(a.exp_avgs, span), optional_fp32_ptr(a.exp_avg_sqs, span),
        optional_fp32_ptr(a.max_exp_avg_sqs, span), optional_fp32_ptr(a.masters.list, span),
        span.size, adam_step);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void adam_cuda(const AdamArgs& a, const at::Tensor& step) {
  check_cuda_step(kAdam, step);
  // An empty list still advances the step count, as on the CPU (the prologue does it).
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::AdamStep>(step.device());
  kernels::cuda::adam(a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs,
                      a.masters.list, a.config, a.scalars, a.write_grads,
                      static_cast<kernels::AdamStep*>(constants.data_ptr()),
                      current_stream(step.device()), a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_adam_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                 at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                 double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                 bool bias_correction, bool amsgrad, bool maximize,
                 const c10::optional<at::Tensor>& grad_scale,
                 const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                 c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed) {
  check_moment_hyperparameters(kAdam, beta1, beta2, eps);
  TORCH_CHECK(amsgrad || max_exp_avg_sqs.empty(), "ampfuse.", kAdam,
              ": max_exp_avg_sqs must be empty when amsgrad is False.");
  AdamArgs a;
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kAdam, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kAdam, params, "params");
  a.params = tensor_refs(kAdam, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kAdam, step, lr, grad_scale, found_inf, device);
  a.write_grads = writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kAdam, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  const auto state = [&](at::TensorList list, const char* name, bool optional) {
    return companion_refs(kAdam, list, name, dense, Access::kWrite, /*fp32_only=*/true, optional,
                          a.keep_alive);
  };
  a.exp_avgs = state(exp_avgs, "exp_avgs", false);
  a.exp_avg_sqs = state(exp_avg_sqs, "exp_avg_sqs", false);
  a.max_exp_avg_sqs = state(max_exp_avg_sqs, "max_exp_avg_sqs", /*optional=*/!amsgrad);
  a.masters = master_args(kAdam, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, amsgrad, maximize};
  if constexpr (kDevice == at::kCPU) {
    adam_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    adam_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_adam_kernels() { return AMPFUSE_KERNELS(fused_adam_); }

}  // namespace ampfuse::ops
