// Argument handling shared by the optimizer ops (fused_adam_, fused_sgd_, fused_adagrad_,
// fused_lamb_, fused_novograd_): the device-side step scalars, their checks, and grads that are
// written back unscaled.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "../kernels/cuda_kernels.h"
#include "checks.h"

namespace ampfuse::ops {

// Checks step, lr and the optional grad_scale/found_inf and returns pointers to them. They
// live on the params' device or, for an empty params list, on step's: the step count still
// advances then, and a flag on another device must not be read as if it were there.
inline kernels::StepScalars step_scalars(const char* op, const at::Tensor& step,
                                         const at::Tensor& lr,
                                         const c10::optional<at::Tensor>& grad_scale,
                                         const c10::optional<at::Tensor>& found_inf,
                                         const c10::optional<at::Device>& params_device) {
  check_scalar_tensor(op, step, "step", at::kFloat, params_device, "params");
  const at::Device device = params_device.value_or(step.device());
  const char* owner = params_device.has_value() ? "params" : "step, as params is empty";
  check_scalar_tensor(op, lr, "lr", at::kFloat, device, owner);
  const auto optional_ptr = [&](const c10::optional<at::Tensor>& t, const char* name) -> float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    check_scalar_tensor(op, *t, name, at::kFloat, device, owner);
    return t->data_ptr<float>();
  };
  return {step.data_ptr<float>(), lr.data_ptr<float>(), optional_ptr(grad_scale, "grad_scale"),
          optional_ptr(found_inf, "found_inf")};
}

// The hyperparameters of Adam's moments, which fused_adam_ and fused_lamb_ share.
inline void check_moment_hyperparameters(const char* op, double beta1, double beta2, double eps) {
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "ampfuse.", op, ": beta1 must be in [0, 1), got ", beta1,
              ".");
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "ampfuse.", op, ": beta2 must be in [0, 1), got ", beta2,
              ".");
  TORCH_CHECK(eps >= 0.0, "ampfuse.", op, ": eps must be >= 0, got ", eps, ".");
}

// The grads are written back only when asked and when there is a scale to divide out.
inline bool writes_grads(bool write_unscaled_grads, const kernels::StepScalars& s) {
  return write_unscaled_grads && s.grad_scale != nullptr;
}

// Validates the grads; with `write` they are written, through a CopyBack when laid out unlike
// their param.
inline std::vector<kernels::TensorRef> grad_refs(const char* op, at::TensorList grads,
                                                 at::TensorList params, bool write,
                                                 std::vector<at::Tensor>& keep_alive,
                                                 std::vector<CopyBack>& copy_back) {
  return companion_refs(op, grads, "grads", params,
                        write ? Access::kWriteOrCopyBack : Access::kRead,
                        /*fp32_only=*/false, /*optional=*/false, keep_alive, &copy_back);
}

// On the CPU the scalars are read directly: a skipped step writes nothing.
inline bool cpu_step_skipped(const kernels::StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.0f;
}

// The step's constants (make_step_constants) from the CPU scalars.
template <typename Config>
auto cpu_step_constants(const Config& config, const kernels::StepScalars& s) {
  return kernels::make_step_constants(config, *s.step, *s.lr,
                                      s.grad_scale != nullptr ? *s.grad_scale : 1.0f);
}

}  // namespace ampfuse::ops
