// NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments",
// the optimizer of NVIDIA's Jasper/QuartzNet), written once for the CPU and CUDA kernels in
// apex.optimizers.FusedNovoGrad's arithmetic.
//
// Each tensor (layer) keeps one running norm of its grads instead of Adam's per-element second
// moment. apex keeps the norm itself, not its square, so that the L2 and the max (infinity)
// norm blend alike:
//   L2:  avg = sqrt(beta2 * avg^2 + (1 - beta2) * ||g||^2)
//   max: avg = beta2 * avg + (1 - beta2) * max|g|
// and the step divides by avg / sqrt(1 - beta2^t) + eps (the bias correction of a norm). On the
// first step avg starts from the step's own norm (so the blend leaves it there), or from 0 with
// init_zero.
//
// A step is two passes over the grads: the first reduces each tensor's grads to its sum of
// squares (or max |g|), the per-tensor blend turns that into the new avg, and the second
// updates the first moment and the param:
//   reg_inside_moment: g' = g / denom + decay * p;  m = beta1 * m + beta3 * g';  p -= lr * m / bc1
//   otherwise (apex's default): m = beta1 * m + beta3 * g;
//                               p -= lr * ((m / bc1) / denom + decay * p)
// with beta3 = 1 - beta1 under grad_averaging (else 1), bc1 = 1 - beta1^t.
#pragma once

#include <cmath>

#include "optimizer_math.h"

namespace ampfuse::kernels {

// Which passes one fused_novograd_ call runs: both, or one half of a sharded step (FSDP2):
// kNorms leaves each tensor's reduction (sum of squares, or max |g|) of its local grads, the
// caller combines them over the shards (a sum, or a max), and kApply takes them back to blend
// the running norms and update the params.
enum class NovoGradPart { kBoth, kNorms, kApply };

struct NovoGradConfig {
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool bias_correction;
  bool grad_averaging;     // the grad enters the first moment times 1 - beta1 (else times 1)
  bool reg_inside_moment;  // apex's moment_mode 0: normalize and decay the grad before the moment
  bool max_norm;           // apex's norm_type 0: the max (infinity) norm; else the L2 norm
  bool init_zero;          // the running norm starts at 0, not at the first step's norm
};

// Per-step constants, derived once per call (on the CPU by the op, on CUDA by a one-thread
// prologue). apex passes its hyperparameters to the kernel as C++ floats and forms the bias
// corrections in double from the float betas; so do these.
struct NovoGradStep {
  float beta1;
  float beta3;  // the grad's weight in the first moment: 1 - beta1, or 1 without grad_averaging
  float beta2;
  float one_minus_beta2;
  float eps;
  float decay;
  float bias_correction1;  // 1 - beta1^t (1 without bias correction)
  float bias_correction2;  // sqrt(1 - beta2^t): the running average is of norms
  float grad_scale;        // the loss scale the grads carry (1 when none)
  float lr;
  bool decayed;  // decay != 0
  bool reg_inside_moment;
  bool max_norm;
  bool seed;  // first step without init_zero: the running norm starts at this step's norm
  float steps_taken;
};

AMPFUSE_HOST_DEVICE inline NovoGradStep make_novograd_constants(const NovoGradConfig& c,
                                                                float steps_taken, float lr,
                                                                float grad_scale) {
  const auto beta1 = static_cast<float>(c.beta1);
  const auto beta2 = static_cast<float>(c.beta2);
  const double t = static_cast<double>(steps_taken) + 1.0;
  NovoGradStep s;
  s.beta1 = beta1;
  s.beta3 = c.grad_averaging ? 1.0f - beta1 : 1.0f;
  s.beta2 = beta2;
  s.one_minus_beta2 = 1.0f - beta2;
  s.eps = static_cast<float>(c.eps);
  s.decay = static_cast<float>(c.weight_decay);
  s.bias_correction1 =
      c.bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(beta1), t)) : 1.0f;
  s.bias_correction2 =
      c.bias_correction ? static_cast<float>(sqrt(1.0 - pow(static_cast<double>(beta2), t))) : 1.0f;
  s.grad_scale = grad_scale;
  s.lr = lr;
  s.decayed = s.decay != 0.0f;
  s.reg_inside_moment = c.reg_inside_moment;
  s.max_norm = c.max_norm;
  s.seed = !c.init_zero && steps_taken == 0.0f;
  s.steps_taken = steps_taken;
  return s;
}

// The max-norm reduction's step: |g| replaces the running maximum when larger, and a NaN
// sticks (a plain fmaxf would drop it, and the norm would hide a NaN grad).
AMPFUSE_HOST_DEVICE inline float max_abs_step(float running, float g) {
  const float a = fabsf(g);
  return (a > running || a != a) ? a : running;
}

// The tensor's new running norm from its old one and this step's reduction of its unscaled
// grads (sum of squares for L2, max |g| for the max norm), in apex's float arithmetic.
AMPFUSE_HOST_DEVICE inline float novograd_blend(float avg, double reduction,
                                                const NovoGradStep& s) {
  const auto r = static_cast<float>(reduction);
  if (s.max_norm) {
    const float old = s.seed ? r : avg;
    return mul(s.beta2, old) + mul(s.one_minus_beta2, r);
  }
  const float old = s.seed ? sqrtf(r) : avg;
  return sqrtf(mul(mul(s.beta2, old), old) + mul(s.one_minus_beta2, r));
}

// What each element of a tensor divides by, from the tensor's new running norm.
AMPFUSE_HOST_DEVICE inline float novograd_denominator(float avg, const NovoGradStep& s) {
  return avg / s.bias_correction2 + s.eps;
}

// The second pass for one element: g the unscaled grad, m the first moment, p the fp32 param
// (the master when there is one), denom the tensor's novograd_denominator.
template <typename F>
AMPFUSE_ELEMENT_FN void novograd_update(F& p, F g, F& m, float denom, const NovoGradStep& s) {
  if (s.reg_inside_moment) {
    g = g / denom;
    g = choose(s.decayed, g + mul(s.decay, p), g);
    m = mul(m, s.beta1) + mul(s.beta3, g);
    p = p - mul(s.lr, m / s.bias_correction1);
  } else {
    m = mul(m, s.beta1) + mul(s.beta3, g);
    F update = (m / s.bias_correction1) / denom;
    update = choose(s.decayed, update + mul(s.decay, p), update);
    p = p - mul(s.lr, update);
  }
}

}  // namespace ampfuse::kernels
