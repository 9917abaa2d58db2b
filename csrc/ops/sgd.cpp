// fused_sgd_: validation, then the CPU span kernel or the CUDA launcher
// (csrc/kernels/sgd.cu).
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

constexpr const char* kSgd = "fused_sgd_";

struct SgdArgs {
  std::vector<kernels::TensorRef> params, grads, momentum_buffers;
  MasterArgs masters;
  kernels::SgdConfig config;
  kernels::StepScalars scalars;
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// The CPU step from the checked arguments.
void sgd_cpu(const SgdArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const kernels::SgdStep sgd_step = cpu_step_constants(a.config, a.scalars);
  const std::vector<Span> spans = split_into_spans(a.params);
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    if (a.masters.is_bf16_mode()) {
      kernels::cpu::sgd_bf16_span(static_cast<std::uint16_t*>(element_ptr(param, span.offset)),
                                  a.masters.span(span, sgd_step.steps_taken),
                                  element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                                  optional_fp32_ptr(a.momentum_buffers, span), span.size, sgd_step);
      return;
    }
    kernels::cpu::sgd_span(element_ptr(param, span.offset), param.dtype,
                           element_ptr(grad, span.offset), grad.dtype, a.write_grads,
                           optional_fp32_ptr(a.momentum_buffers, span),
                           optional_fp32_ptr(a.masters.list, span), span.size, sgd_step);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void sgd_cuda(const SgdArgs& a, const at::Tensor& step) {
  check_cuda_step(kSgd, step);
  // An empty list still advances the step count, as on the CPU (the prologue does it).
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::SgdStep>(step.device());
  kernels::cuda::sgd(a.params, a.grads, a.momentum_buffers, a.masters.list, a.config, a.scalars,
                     a.write_grads, static_cast<kernels::SgdStep*>(constants.data_ptr()),
                     current_stream(step.device()), a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_sgd_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                double momentum, double dampening, double weight_decay, bool nesterov,
                bool maximize, const c10::optional<at::Tensor>& grad_scale,
                const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                bool wd_after_momentum, c10::string_view master_mode, at::IntArrayRef param_ids,
                int64_t seed) {
  TORCH_CHECK(momentum >= 0.0, "ampfuse.", kSgd, ": momentum must be >= 0, got ", momentum, ".");
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), "ampfuse.", kSgd,
              ": nesterov needs momentum > 0 and dampening == 0.");
  TORCH_CHECK((momentum == 0.0) == momentum_buffers.empty(), "ampfuse.", kSgd,
              ": pass one momentum buffer per param when momentum != 0, and none when it is 0.");
  SgdArgs a;
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kSgd, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kSgd, params, "params");
  a.params = tensor_refs(kSgd, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kSgd, step, lr, grad_scale, found_inf, device);
  a.write_grads = writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kSgd, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  a.momentum_buffers = companion_refs(kSgd, momentum_buffers, "momentum_buffers", dense,
                                      Access::kWrite, true, /*optional=*/true, a.keep_alive);
  a.masters = master_args(kSgd, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {momentum, dampening, weight_decay, nesterov, maximize, wd_after_momentum};
  if constexpr (kDevice == at::kCPU) {
    sgd_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    sgd_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_sgd_kernels() { return AMPFUSE_KERNELS(fused_sgd_); }

}  // namespace ampfuse::ops
