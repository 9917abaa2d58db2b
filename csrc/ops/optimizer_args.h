// Argument handling shared by fused_adam_ and fused_sgd_: the device-side step
// scalars and their checks.
#pragma once

#include <ATen/core/Tensor.h>

#include "../kernels/cuda_kernels.h"
#include "checks.h"

namespace ampfuse::ops {

// Checks step, lr and the optional grad_scale/found_inf against the params'
// device and returns pointers to them.
inline kernels::StepScalars step_scalars(const char* op, const at::Tensor& step,
                                               const at::Tensor& lr,
                                               const c10::optional<at::Tensor>& grad_scale,
                                               const c10::optional<at::Tensor>& found_inf,
                                               const c10::optional<at::Device>& device) {
  check_scalar_tensor(op, step, "step", at::kFloat, device, "params");
  check_scalar_tensor(op, lr, "lr", at::kFloat, device, "params");
  const auto optional_ptr = [&](const c10::optional<at::Tensor>& t, const char* name) -> float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    check_scalar_tensor(op, *t, name, at::kFloat, device, "params");
    return t->data_ptr<float>();
  };
  return {step.data_ptr<float>(), lr.data_ptr<float>(), optional_ptr(grad_scale, "grad_scale"),
          optional_ptr(found_inf, "found_inf")};
}

// On the CPU the scalars are read directly: a skipped step writes nothing.
inline bool cpu_step_skipped(const kernels::StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.0f;
}

inline float cpu_grad_factor(const kernels::StepScalars& s) {
  return s.grad_scale != nullptr ? 1.0f / *s.grad_scale : 1.0f;
}

}  // namespace ampfuse::ops
