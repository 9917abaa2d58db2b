// The per-element Adam/AdamW and SGD updates, written once for the CPU and CUDA
// kernels. All math is fp32 and follows torch.optim's order of operations (lerp
// for the first moment, addcmul for the second, addcdiv for the step), so a
// fused step tracks torch's fp32 optimizers to within rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

namespace ampfuse::kernels {

// The element functions below are templates over their float type: float, or cpu::Lanes8 for
// eight elements at once. Host builds always inline them. A Lanes8 instance emitted out of line
// would be baseline code that takes its 32-byte vectors in memory while the AVX2 loops calling
// it pass them in registers: silently wrong numbers, where always_inline makes a failure to
// inline a compile error. nvcc builds keep plain inline (Lanes8 never reaches device code).
#if defined(__CUDACC__)
#define AMPFUSE_ELEMENT_FN AMPFUSE_HOST_DEVICE inline
#else
#define AMPFUSE_ELEMENT_FN inline __attribute__((always_inline))
#endif

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

// `on ? if_on : if_off` for a per-step option `on`: the same choice for every element of a step.
// On the GPU and in the CPU's 8-lane loops (cpu/lanes8.h) it is a branch that never diverges or
// mispredicts, and the compilers sink the arithmetic of each side into its branch, so an option
// that is off costs nothing. The host's scalar loops pick with select_float instead: GCC does not
// vectorize a loop holding such branches ("control flow in loop") and unswitches at most three.
template <typename F>
AMPFUSE_ELEMENT_FN F choose(bool on, F if_on, F if_off) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<F, float>) {
    return select_float(on, if_on, if_off);
  } else
#endif
  {
    if (on) return if_on;
    return if_off;
  }
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
//
// Without a loss scale the CPU's lane loops skip the division: g / 1 is g bit for bit (a
// signalling nan aside, which the update's arithmetic quiets anyway), and on Zen 5 the divider
// bounds the CPU's fp32-state steps (three divisions and a square root per element in Adam):
// skipping one made FusedAdamW's CPU step 5-17% faster there (benchmarks/RESULTS.md,
// 2026-11-29). On a Zen 4 it does not bound them (RESULTS.md, the tenth session's A/B).
// The branch goes the same way for a whole call, so it never mispredicts. Scalar code and the
// GPU (bound by memory there) always divide.
template <typename F>
AMPFUSE_ELEMENT_FN F unscale_grad(F g, float grad_scale) {
  if constexpr (!std::is_same_v<F, float>) {
    if (grad_scale == 1.0f) return g;
  }
  return g / grad_scale;
}

// sqrtf, by a name that lane types overload (cpu/lanes8.h).
AMPFUSE_HOST_DEVICE inline float square_root(float x) { return sqrtf(x); }

// Per-step constants of an Adam update, derived once per call: on the CPU by the op, on CUDA by
// a one-thread prologue kernel from the device-side step count and learning rate.
// Scalars that torch forms in Python (double) are formed in double here too and
// rounded once, so both round the same way. An option that is off is skipped, as torch skips
// it: the update picks each side with choose(), a branch that costs nothing for lanes and on the
// GPU. (Until 2026-11 options were multipliers such as x + 0 * p, which cost a multiply and an
// add per element each, and made inf/nan params NaN where torch keeps them.)
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
  bool maximize;                // the grad is negated
  bool l2;                      // l2_decay != 0: tested as a bool, hoisted; a float compare is not
  bool decoupled;               // decoupled_decay != 1
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
      c.adam_w_mode ? static_cast<float>(1.0 - mul(static_cast<double>(lr), c.weight_decay)) : 1.0f;
  s.step_size = static_cast<float>(static_cast<double>(lr) / bias_correction1);
  s.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.grad_scale = grad_scale;
  s.maximize = c.maximize;
  s.l2 = s.l2_decay != 0.0f;
  s.decoupled = s.decoupled_decay != 1.0f;
  s.lerp_from_start = s.one_minus_beta1 < 0.5f;
  s.amsgrad = c.amsgrad;
  s.steps_taken = steps_taken;
  return s;
}

// One element: p is the fp32 parameter (the master when there is one), g the
// unscaled gradient (unscale_grad), m/v the moments, max_v the AMSGrad maximum (used when
// kAmsgrad). F is float, or eight elements at once as cpu::Lanes8 (each lane rounds as the
// float code does). `root` receives the square root the update divides by, sqrt(v) or
// sqrt(max_v): the CPU's 8-bit moment codes store sqrt(v) and take it from here rather than
// forming it a second time.
template <bool kAmsgrad, typename F>
AMPFUSE_ELEMENT_FN void adam_update(F& p, F g, F& m, F& v, F& max_v, const AdamStep& s, F& root) {
  g = choose(s.maximize, -g, g);
  g = choose(s.l2, g + mul(s.l2_decay, p), g);
  p = choose(s.decoupled, mul(p, s.decoupled_decay), p);
  // torch's lerp picks one of two formulas by the weight, to stay exact at both ends.
  const float w = s.one_minus_beta1;
  m = choose(s.lerp_from_start, m + mul(w, g - m), g - mul(g - m, 1.0f - w));
  v = mul(v, s.beta2) + mul(mul(s.one_minus_beta2, g), g);
  F second = v;
  if (kAmsgrad) {
    // NaN in v propagates, as with torch.maximum.
    max_v = select_float(max_v > v, max_v, v);
    second = max_v;
  }
  root = square_root(second);
  const F denom = root / s.bias_correction2_sqrt + s.eps;
  p += mul(-s.step_size, m / denom);
}

template <bool kAmsgrad, typename F>
AMPFUSE_ELEMENT_FN void adam_update(F& p, F g, F& m, F& v, F& max_v, const AdamStep& s) {
  F root;
  adam_update<kAmsgrad>(p, g, m, v, max_v, s, root);
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

// Per-step constants of an SGD update; options that are off are skipped, as in AdamStep.
// Weight decay is one of two amounts, the other 0.
struct SgdStep {
  float lr;
  float grad_scale;  // the loss scale the grads carry (1 when none)
  bool maximize;     // the grad is negated
  float momentum;
  float one_minus_dampening;
  float decay_before_momentum;
  float decay_after_momentum;
  bool dampened;      // one_minus_dampening != 1 (bools are tested once per loop, see AdamStep)
  bool decay_before;  // decay_before_momentum != 0
  bool decay_after;   // decay_after_momentum != 0
  bool nesterov;
  bool first_step;    // seeds the momentum buffer with the grad, as torch does on its first step
  float steps_taken;  // the count before this step: keys stochastic rounding (bf16_modes.h)
};

AMPFUSE_HOST_DEVICE inline SgdStep make_step_constants(const SgdConfig& c, float steps_taken,
                                                       float lr, float grad_scale) {
  SgdStep s;
  s.lr = lr;
  s.grad_scale = grad_scale;
  s.maximize = c.maximize;
  s.momentum = static_cast<float>(c.momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  const auto decay = static_cast<float>(c.weight_decay);
  s.decay_before_momentum = c.wd_after_momentum ? 0.0f : decay;
  s.decay_after_momentum = c.wd_after_momentum ? decay : 0.0f;
  s.dampened = s.one_minus_dampening != 1.0f;
  s.decay_before = s.decay_before_momentum != 0.0f;
  s.decay_after = s.decay_after_momentum != 0.0f;
  s.nesterov = c.nesterov;
  s.first_step = steps_taken == 0.0f;
  s.steps_taken = steps_taken;
  return s;
}

// One element of SGD: p as in adam_update, g the unscaled gradient. kMomentum selects the
// buffer update. F as in adam_update.
template <bool kMomentum, typename F>
AMPFUSE_ELEMENT_FN void sgd_update(F& p, F g, F& momentum_buffer, const SgdStep& s) {
  g = choose(s.maximize, -g, g);
  g = choose(s.decay_before, g + mul(s.decay_before_momentum, p), g);
  if (kMomentum) {
    // (1 - dampening) * g is g itself without dampening, the usual case.
    const F fresh = choose(s.dampened, mul(s.one_minus_dampening, g), g);
    momentum_buffer = choose(s.first_step, g, mul(momentum_buffer, s.momentum) + fresh);
    g = choose(s.nesterov, g + mul(s.momentum, momentum_buffer), momentum_buffer);
  }
  g = choose(s.decay_after, g + mul(s.decay_after_momentum, p), g);
  p += mul(-s.lr, g);
}

}  // namespace ampfuse::kernels
