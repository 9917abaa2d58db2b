// The per-element Adam/AdamW and SGD updates, written once for the CPU and CUDA
// kernels. All math is fp32 and follows torch.optim's order of operations (lerp
// for the first moment, addcmul for the second, addcdiv for the step), so a
// fused step tracks torch's fp32 optimizers to within rounding.
#pragma once

#include <cmath>
#include <cstdint>

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

namespace ampfuse::kernels {

// cond ? a : b. On the host it is written with bit masks because GCC 12 keeps a
// float ternary as a branch and then refuses to vectorize the loop around it.
AMPFUSE_HOST_DEVICE inline float select_float(bool cond, float a, float b) {
#if defined(__CUDA_ARCH__)
  return cond ? a : b;
#else
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return __builtin_bit_cast(float, (__builtin_bit_cast(std::uint32_t, a) & mask) |
                                       (__builtin_bit_cast(std::uint32_t, b) & ~mask));
#endif
}

// Products that are never fused with a following add into an FMA. nvcc contracts a * b + c
// into one FMA (one rounding) by default; the CPU build rounds the product first
// (-ffp-contract=off). With these, both round every operation alike, so CUDA and CPU
// optimizer steps are bit-identical for the same inputs and constants.
AMPFUSE_HOST_DEVICE inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

AMPFUSE_HOST_DEVICE inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// Inputs of an optimizer step that live in device memory. step counts the steps taken so far and
// is advanced after the update unless *found_inf != 0, in which case nothing at
// all is written (the grads included). grad_scale and found_inf may be null.
struct StepScalars {
  float* step;
  const float* lr;
  const float* grad_scale;
  const float* found_inf;
};

// The grad with the loss scale divided out: a true division, as torch's fused optimizers do, so
// the unscaled grad an optimizer writes back into p.grad is torch's bit for bit (g * (1/s)
// differs in the last bit when s is not a power of two). grad_scale is 1 when there is none.
AMPFUSE_HOST_DEVICE inline float unscale_grad(float g, float grad_scale) { return g / grad_scale; }

// Per-step constants of an Adam update, derived once per call: on the CPU by the op, on CUDA by
// a one-thread prologue kernel from the device-side step count and learning rate.
// Scalars that torch forms in Python (double) are formed in double here too and
// rounded once, so both round the same way. Options become multipliers that are
// exact no-ops when off (x * 1, x + 0 * p for finite p), which keeps the update
// branch-free so CPU loops over it vectorize.
struct AdamStep {
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float l2_decay;               // Adam's weight decay added to the gradient (0 for AdamW)
  float decoupled_decay;        // AdamW's 1 - lr * weight_decay (1 for Adam)
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float grad_scale;             // the loss scale the grads carry (1 when none)
  float grad_sign;              // -1 for `maximize`, else 1
  bool lerp_from_start;         // which of torch's two lerp formulas applies
  bool amsgrad;
  float steps_taken;  // the count before this step: keys stochastic rounding (bf16_modes.h)
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
AMPFUSE_HOST_DEVICE inline AdamStep make_step_constants(const AdamConfig& c, float steps_taken,
                                                        float lr, float grad_scale) {
  const double t = static_cast<double>(steps_taken) + 1.0;
  const double bias_correction1 = c.bias_correction ? 1.0 - pow(c.beta1, t) : 1.0;
  const double bias_correction2 = c.bias_correction ? 1.0 - pow(c.beta2, t) : 1.0;
  AdamStep s;
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.eps = static_cast<float>(c.eps);
  s.l2_decay = c.adam_w_mode ? 0.0f : static_cast<float>(c.weight_decay);
  s.decoupled_decay =
      c.adam_w_mode ? static_cast<float>(1.0 - mul(static_cast<double>(lr), c.weight_decay))
                    : 1.0f;
  s.step_size = static_cast<float>(static_cast<double>(lr) / bias_correction1);
  s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.grad_scale = grad_scale;
  s.grad_sign = c.maximize ? -1.0f : 1.0f;
  s.lerp_from_start = s.one_minus_beta1 < 0.5f;
  s.amsgrad = c.amsgrad;
  s.steps_taken = steps_taken;
  return s;
}

// One element: p is the fp32 parameter (the master when there is one), g the
// unscaled gradient (unscale_grad), m/v the moments, max_v the AMSGrad maximum (used when
// kAmsgrad).
template <bool kAmsgrad>
AMPFUSE_HOST_DEVICE inline void adam_update(float& p, float g, float& m, float& v, float& max_v,
                                            const AdamStep& s) {
  g = mul(g, s.grad_sign) + mul(s.l2_decay, p);
  p = mul(p, s.decoupled_decay);
  // torch's lerp picks one of two formulas by the weight, to stay exact at both ends.
  const float w = s.one_minus_beta1;
  const float from_start = m + mul(w, g - m);
  const float from_end = g - mul(g - m, 1.0f - w);
  m = select_float(s.lerp_from_start, from_start, from_end);
  v = mul(v, s.beta2) + mul(mul(s.one_minus_beta2, g), g);
  float second = v;
  if (kAmsgrad) {
    // NaN in v propagates, as with torch.maximum.
    max_v = select_float(max_v > v, max_v, v);
    second = max_v;
  }
  const float denom = sqrtf(second) / s.bias_correction2_sqrt + s.eps;
  p += mul(-s.step_size, m / denom);
}

struct SgdConfig {
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
  // apex's option: weight decay is added to the update after the momentum step instead of to
  // the grad before it, so the momentum buffer never sees it.
  bool wd_after_momentum;
};

// Per-step constants of an SGD update. Weight decay is one of two multipliers, the other 0,
// so both placements run the same branch-free code (x + 0 * p == x for finite p).
struct SgdStep {
  float lr;
  float grad_scale;  // the loss scale the grads carry (1 when none)
  float grad_sign;   // -1 for `maximize`, else 1
  float momentum;
  float one_minus_dampening;
  float decay_before_momentum;
  float decay_after_momentum;
  bool nesterov;
  bool first_step;  // seeds the momentum buffer with the grad, as torch does on its first step
  float steps_taken;  // the count before this step: keys stochastic rounding (bf16_modes.h)
};

AMPFUSE_HOST_DEVICE inline SgdStep make_step_constants(const SgdConfig& c, float steps_taken,
                                                       float lr, float grad_scale) {
  SgdStep s;
  s.lr = lr;
  s.grad_scale = grad_scale;
  s.grad_sign = c.maximize ? -1.0f : 1.0f;
  s.momentum = static_cast<float>(c.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  const auto decay = static_cast<float>(c.weight_decay);
  s.decay_before_momentum = c.wd_after_momentum ? 0.0f : decay;
  s.decay_after_momentum = c.wd_after_momentum ? decay : 0.0f;
  s.nesterov = c.nesterov;
  s.first_step = steps_taken == 0.0f;
  s.steps_taken = steps_taken;
  return s;
}

// One element of SGD: p as in adam_update, g the unscaled gradient. kMomentum selects the
// buffer update.
template <bool kMomentum>
AMPFUSE_HOST_DEVICE inline void sgd_update(float& p, float g, float& momentum_buffer,
                                           const SgdStep& s) {
  g = mul(g, s.grad_sign) + mul(s.decay_before_momentum, p);
  if (kMomentum) {
    const float continued = mul(momentum_buffer, s.momentum) + mul(s.one_minus_dampening, g);
    const float buf = select_float(s.first_step, g, continued);
    momentum_buffer = buf;
    g = select_float(s.nesterov, g + mul(s.momentum, buf), buf);
  }
  g = g + mul(s.decay_after_momentum, p);
  p += mul(-s.lr, g);
}

}  // namespace ampfuse::kernels
