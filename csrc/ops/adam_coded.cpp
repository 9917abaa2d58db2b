// fused_adam_coded_: fused_adam_ with Adam's moments held as 8-bit block codes
// (kernels/state_codes.h): validation, then the CPU span kernel or the CUDA launcher
// (csrc/kernels/adam_coded.cu).
#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../kernels/state_codes.h"
#include "../ops.h"
#include "checks.h"
#include "coded_args.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "master_args.h"
#include "optimizer_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kAdamCoded = "fused_adam_coded_";
using kernels::StateCode;

struct AdamCodedArgs {
  std::vector<kernels::TensorRef> params, grads;
  kernels::cuda::CodedMomentLists moments;
  MasterArgs masters;
  kernels::AdamConfig config;
  kernels::StepScalars scalars;
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// The CPU step from the checked arguments.
void adam_coded_cpu(const AdamCodedArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const kernels::AdamStep adam_step = cpu_step_constants(a.config, a.scalars);
  const std::vector<Span> spans = split_into_spans(a.params);
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    const bool bf16_mode = a.masters.is_bf16_mode();
    kernels::cpu::Bf16Span bf16{};
    if (bf16_mode) bf16 = a.masters.span(span, adam_step.steps_taken);
    kernels::cpu::adam_coded_span(element_ptr(param, span.offset), param.dtype,
                                  element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                                  span_moments(a.moments, span),
                                  bf16_mode ? nullptr : optional_fp32_ptr(a.masters.list, span),
                                  bf16_mode ? &bf16 : nullptr, span.size, adam_step);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void adam_coded_cuda(const AdamCodedArgs& a, const at::Tensor& step) {
  check_cuda_step(kAdamCoded, step);
  // An empty list still advances the step count, as on the CPU (the prologue does it).
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::AdamStep>(step.device());
  kernels::cuda::adam_coded(a.params, a.grads, a.moments, a.masters.list, a.config, a.scalars,
                            a.write_grads, static_cast<kernels::AdamStep*>(constants.data_ptr()),
                            current_stream(step.device()), a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_adam_coded_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_adam_coded_(at::TensorList params, at::TensorList grads, at::TensorList exp_avg_codes,
                       at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                       at::TensorList exp_avg_sq_scales, at::TensorList max_exp_avg_sq_codes,
                       at::TensorList max_exp_avg_sq_scales, at::TensorList master_params,
                       const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
                       double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                       bool amsgrad, bool maximize, const c10::optional<at::Tensor>& grad_scale,
                       const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                       c10::string_view state_dtype, c10::string_view master_mode,
                       at::IntArrayRef param_ids, int64_t seed) {
  check_moment_hyperparameters(kAdamCoded, beta1, beta2, eps);
  TORCH_CHECK(amsgrad || (max_exp_avg_sq_codes.empty() && max_exp_avg_sq_scales.empty()),
              "ampfuse.", kAdamCoded,
              ": max_exp_avg_sq_codes and max_exp_avg_sq_scales must be "
              "empty when amsgrad is False.");
  AdamCodedArgs a;
  const StateCode code = parse_state_dtype(kAdamCoded, state_dtype, "fused_adam_");
  a.moments.code = code;
  // Any size: which params code their moments is the optimizer's choice, by the whole param's
  // size, so an FSDP2 rank may hold a shard of a coded param under one block, or none of it.
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kAdamCoded, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kAdamCoded, params, "params");
  a.params = tensor_refs(kAdamCoded, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kAdamCoded, step, lr, grad_scale, found_inf, device);
  a.write_grads = writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kAdamCoded, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  kernels::cuda::CodedMomentLists& m = a.moments;
  check_coded_moment(kAdamCoded, dense, exp_avg_codes, "exp_avg_codes", exp_avg_scales,
                     "exp_avg_scales", code, /*second=*/false, /*optional=*/false, m.exp_avg_codes,
                     m.exp_avg_scales);
  check_coded_moment(kAdamCoded, dense, exp_avg_sq_codes, "exp_avg_sq_codes", exp_avg_sq_scales,
                     "exp_avg_sq_scales", code, /*second=*/true, /*optional=*/false,
                     m.exp_avg_sq_codes, m.exp_avg_sq_scales);
  check_coded_moment(kAdamCoded, dense, max_exp_avg_sq_codes, "max_exp_avg_sq_codes",
                     max_exp_avg_sq_scales, "max_exp_avg_sq_scales", code, /*second=*/true,
                     /*optional=*/!amsgrad, m.max_exp_avg_sq_codes, m.max_exp_avg_sq_scales);
  a.masters =
      master_args(kAdamCoded, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, amsgrad, maximize};
  if constexpr (kDevice == at::kCPU) {
    adam_coded_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    adam_coded_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_adam_coded_kernels() { return AMPFUSE_KERNELS(fused_adam_coded_); }

}  // namespace ampfuse::ops
