// fused_adagrad_: validation, then the CPU span kernel or the CUDA launcher
// (csrc/kernels/adagrad.cu).
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

constexpr const char* kAdagrad = "fused_adagrad_";

struct AdagradArgs {
  std::vector<kernels::TensorRef> params, grads, state_sums;
  MasterArgs masters;
  kernels::AdagradConfig config;
  kernels::StepScalars scalars;
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// The CPU step from the checked arguments.
void adagrad_cpu(const AdagradArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const kernels::AdagradStep adagrad_step = cpu_step_constants(a.config, a.scalars);
  const std::vector<Span> spans = split_into_spans(a.params);
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    if (a.masters.is_bf16_mode()) {
      kernels::cpu::adagrad_bf16_span(static_cast<std::uint16_t*>(element_ptr(param, span.offset)),
                                      a.masters.span(span, adagrad_step.steps_taken),
                                      element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                                      optional_fp32_ptr(a.state_sums, span), span.size,
                                      adagrad_step);
      return;
    }
    kernels::cpu::adagrad_span(element_ptr(param, span.offset), param.dtype,
                               element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                               optional_fp32_ptr(a.state_sums, span),
                               optional_fp32_ptr(a.masters.list, span), span.size, adagrad_step);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void adagrad_cuda(const AdagradArgs& a, const at::Tensor& step) {
  check_cuda_step(kAdagrad, step);
  // An empty list still advances the step count, as on the CPU (the prologue does it).
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::AdagradStep>(step.device());
  kernels::cuda::adagrad(a.params, a.grads, a.state_sums, a.masters.list, a.config, a.scalars,
                         a.write_grads, static_cast<kernels::AdagradStep*>(constants.data_ptr()),
                         current_stream(step.device()), a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_adagrad_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_adagrad_(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                    at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                    double lr_decay, double weight_decay, double eps, bool decoupled_weight_decay,
                    bool maximize, const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                    c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed) {
  TORCH_CHECK(lr_decay >= 0.0, "ampfuse.", kAdagrad, ": lr_decay must be >= 0, got ", lr_decay,
              ".");
  TORCH_CHECK(weight_decay >= 0.0, "ampfuse.", kAdagrad, ": weight_decay must be >= 0, got ",
              weight_decay, ".");
  TORCH_CHECK(eps >= 0.0, "ampfuse.", kAdagrad, ": eps must be >= 0, got ", eps, ".");
  AdagradArgs a;
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kAdagrad, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kAdagrad, params, "params");
  a.params = tensor_refs(kAdagrad, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kAdagrad, step, lr, grad_scale, found_inf, device);
  a.write_grads = writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kAdagrad, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  a.state_sums = companion_refs(kAdagrad, state_sums, "state_sums", dense, Access::kWrite,
                                /*fp32_only=*/true, /*optional=*/false, a.keep_alive);
  a.masters =
      master_args(kAdagrad, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {lr_decay, weight_decay, eps, decoupled_weight_decay, maximize};
  if constexpr (kDevice == at::kCPU) {
    adagrad_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    adagrad_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_adagrad_kernels() { return AMPFUSE_KERNELS(fused_adagrad_); }

}  // namespace ampfuse::ops
