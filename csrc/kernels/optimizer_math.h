// The per-element Adam/AdamW and SGD updates, written once for the CPU and CUDA
// kernels. All math is fp32 and follows torch.optim's order of operations (lerp
// for the first moment, addcmul for the second, addcdiv for the step), so a
// fused step tracks torch's fp32 optimizers to within rounding.
#pragma once

#include <cmath>
#include <cstdint>

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

namespace ampfuse::kernels {

// Inputs of an optimizer step that live in device memory. step counts the steps taken so far and
// is advanced after the update unless *found_inf != 0, in which case nothing at
// all is written. grad_scale and found_inf may be null.
struct StepScalars {
  float* step;
  const float* lr;
  const float* grad_scale;
  const float* found_inf;
};

// Per-step constants of an Adam update, derived once per call (CPU) or per block
// (CUDA) from the device-side step count and learning rate.
// Scalars that torch forms in Python (double) are formed in double here too and
// rounded once, so both round the same way.
struct AdamStep {
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;           // Adam's L2 term
  float decoupled_decay;        // AdamW's 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float grad_factor;            // 1 / grad_scale (1 when there is none)
  bool adam_w_mode;
  bool amsgrad;
  bool maximize;
};

struct AdamConfig {
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool adam_w_mode;
  bool bias_correction;
  bool amsgrad;
  bool maximize;
};

// Bias corrections are formed in double from t = steps_taken + 1, as torch does in
// Python, then rounded once to float.
AMPFUSE_HOST_DEVICE inline AdamStep make_adam_step(const AdamConfig& c, float steps_taken,
                                                   float lr, float grad_factor) {
  const double t = static_cast<double>(steps_taken) + 1.0;
  const double bias_correction1 = c.bias_correction ? 1.0 - pow(c.beta1, t) : 1.0;
  const double bias_correction2 = c.bias_correction ? 1.0 - pow(c.beta2, t) : 1.0;
  AdamStep s;
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.eps = static_cast<float>(c.eps);
  s.weight_decay = static_cast<float>(c.weight_decay);
  s.decoupled_decay = static_cast<float>(1.0 - static_cast<double>(lr) * c.weight_decay);
  s.step_size = static_cast<float>(static_cast<double>(lr) / bias_correction1);
  s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.grad_factor = grad_factor;
  s.adam_w_mode = c.adam_w_mode;
  s.amsgrad = c.amsgrad;
  s.maximize = c.maximize;
  return s;
}

// One element: p is the fp32 parameter (the master when there is one), g the
// gradient as read, m/v the moments, max_v the AMSGrad maximum (ignored unless amsgrad).
AMPFUSE_HOST_DEVICE inline void adam_update(float& p, float g, float& m, float& v, float& max_v,
                                            const AdamStep& s) {
  g *= s.grad_factor;
  if (s.maximize) g = -g;
  if (s.weight_decay != 0.0f) {
    if (s.adam_w_mode) {
      p *= s.decoupled_decay;
    } else {
      g += s.weight_decay * p;
    }
  }
  // torch's lerp: the formula is chosen by the weight to stay exact at both ends.
  const float w = s.one_minus_beta1;
  m = w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
  v = v * s.beta2 + s.one_minus_beta2 * g * g;
  float second = v;
  if (s.amsgrad) {
    max_v = max_v > v ? max_v : v;
    second = max_v;
  }
  const float denom = sqrtf(second) / s.bias_correction2_sqrt + s.eps;
  p += -s.step_size * (m / denom);
}

struct SgdConfig {
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
};

// One element of SGD. `first_step` seeds the momentum buffer with the gradient,
// as torch does when the buffer does not exist yet.
AMPFUSE_HOST_DEVICE inline void sgd_update(float& p, float g, float* momentum_buffer,
                                           const SgdConfig& c, float lr, float grad_factor,
                                           bool first_step) {
  g *= grad_factor;
  if (c.maximize) g = -g;
  const auto weight_decay = static_cast<float>(c.weight_decay);
  if (weight_decay != 0.0f) g += weight_decay * p;
  if (momentum_buffer != nullptr) {
    const auto momentum = static_cast<float>(c.momentum);
    float buf = *momentum_buffer;
    buf = first_step ? g : buf * momentum + static_cast<float>(1.0 - c.dampening) * g;
    *momentum_buffer = buf;
    g = c.nesterov ? g + momentum * buf : buf;
  }
  p += -lr * g;
}

}  // namespace ampfuse::kernels
