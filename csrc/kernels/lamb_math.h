// The per-element LAMB update (You et al., "Large Batch Optimization for Deep Learning"), written
// once for the CPU and CUDA kernels, in apex.optimizers.FusedLAMB's arithmetic: the grads are
// divided by the loss scale and then by the global grad-norm clip, the moments are updated as
// Adam's (with LAMB's grad_averaging), and the Adam direction plus decoupled weight decay is the
// "update". A second pass scales each tensor's update by its trust ratio
// ||param|| / ||update|| and subtracts it.
//
// apex writes the update into the grads between its two passes. Here the first pass stores only
// the moments, and the second recomputes the update from them: lamb_direction() of the stored
// moments is the update of the first pass bit for bit, the grads are left as torch users expect
// them, and no scratch array is needed.
#pragma once

#include <cmath>

#include "optimizer_math.h"

namespace ampfuse::kernels {

// Which passes one fused_lamb_ call runs: both, or one of the two halves of a sharded step
// (FSDP2): kMoments leaves each tensor's sums of squares of param and update, the caller adds
// them over the shards, and kApply takes them back to form the trust ratios.
enum class LambPart { kBoth, kMoments, kApply };

struct LambConfig {
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double max_grad_norm;  // clip the global grad norm to this; 0: no clipping
  bool adam_w_mode;      // decoupled weight decay (true) or L2 added to the grad (false)
  bool bias_correction;
  bool grad_averaging;  // the grad enters the first moment times 1 - beta1 (else times 1)
  bool use_nvlamb;      // trust ratio also for params without weight decay
};

// Per-step constants, derived once per call as AdamStep is (on the CPU by the op, on CUDA by the
// one-thread prologue). apex passes its hyperparameters to the kernel as C++ floats and forms
// the bias corrections in double from those floats; so do these.
struct LambStep {
  float beta1;
  float beta3;  // the grad's weight in the first moment: 1 - beta1, or 1 without grad_averaging
  float beta2;
  float one_minus_beta2;
  float eps;
  float decay;
  float bias_correction1;  // 1 - beta1^t (1 without bias correction)
  float bias_correction2;
  float clip_divisor;  // ||unscaled grads|| / max_grad_norm when above 1, else 1
  float grad_scale;    // the loss scale the grads carry (1 when none)
  float lr;
  bool l2;         // adam_w_mode false and decay != 0: decay * p joins the grad
  bool decoupled;  // adam_w_mode true and decay != 0: decay * p joins the update
  bool clipped;    // clip_divisor != 1
  bool trust;      // scale the update by the trust ratio (decay != 0 or use_nvlamb)
  float steps_taken;
};

// grad_norm is the global L2 norm of the step's grads as the op receives them (still carrying
// grad_scale); it is read only when max_grad_norm > 0. A NaN norm leaves the grads unclipped,
// as in apex (the NaN reaches the params through the grads themselves).
AMPFUSE_HOST_DEVICE inline LambStep make_lamb_constants(const LambConfig& c, float steps_taken,
                                                        float lr, float grad_scale,
                                                        float grad_norm) {
  const auto beta1 = static_cast<float>(c.beta1);
  const auto beta2 = static_cast<float>(c.beta2);
  const double t = static_cast<double>(steps_taken) + 1.0;
  LambStep s;
  s.beta1 = beta1;
  s.beta3 = c.grad_averaging ? 1.0f - beta1 : 1.0f;
  s.beta2 = beta2;
  s.one_minus_beta2 = 1.0f - beta2;
  s.eps = static_cast<float>(c.eps);
  s.decay = static_cast<float>(c.weight_decay);
  s.bias_correction1 =
      c.bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(beta1), t)) : 1.0f;
  s.bias_correction2 =
      c.bias_correction ? static_cast<float>(1.0 - pow(static_cast<double>(beta2), t)) : 1.0f;
  s.clip_divisor = 1.0f;
  if (c.max_grad_norm > 0.0) {
    const auto max_norm = static_cast<float>(c.max_grad_norm);
    const float unscaled_norm = grad_norm / grad_scale;
    if (unscaled_norm > max_norm) s.clip_divisor = unscaled_norm / max_norm;
  }
  s.grad_scale = grad_scale;
  s.lr = lr;
  s.l2 = !c.adam_w_mode && s.decay != 0.0f;
  s.decoupled = c.adam_w_mode && s.decay != 0.0f;
  s.clipped = s.clip_divisor != 1.0f;
  s.trust = c.use_nvlamb || s.decay != 0.0f;
  s.steps_taken = steps_taken;
  return s;
}

// The update from the new moments m, v and the fp32 param p (the master when there is one).
template <typename F>
AMPFUSE_ELEMENT_FN F lamb_direction(F m, F v, F p, const LambStep& s) {
  const F adam = (m / s.bias_correction1) / (square_root(v / s.bias_correction2) + s.eps);
  return choose(s.decoupled, adam + mul(s.decay, p), adam);
}

// The first pass for one element: g is the grad with the loss scale divided out (unscale_grad);
// updates m and v and returns the update whose norm the trust ratio needs.
template <typename F>
AMPFUSE_ELEMENT_FN F lamb_moments(F g, F p, F& m, F& v, const LambStep& s) {
  g = choose(s.clipped, g / s.clip_divisor, g);
  g = choose(s.l2, g + mul(s.decay, p), g);
  m = mul(m, s.beta1) + mul(s.beta3, g);
  v = mul(v, s.beta2) + mul(mul(s.one_minus_beta2, g), g);
  return lamb_direction(m, v, p, s);
}

// The step size of one tensor from the L2 norms of its param (before the step) and its update,
// in fp32 as apex forms it. A zero norm on either side falls back to the plain learning rate.
AMPFUSE_HOST_DEVICE inline float lamb_ratio(float param_norm, float update_norm,
                                            const LambStep& s) {
  if (!s.trust || param_norm == 0.0f || update_norm == 0.0f) return s.lr;
  return s.lr * (param_norm / update_norm);
}

// The second pass for one element given its update: what lamb_moments returned for these
// moments and this p, or lamb_direction of them (the same bits).
template <typename F>
AMPFUSE_ELEMENT_FN void lamb_apply_update(F& p, F update, float ratio) {
  p = p - mul(ratio, update);
}

// The second pass for one element: m, v are the moments the first pass stored.
template <typename F>
AMPFUSE_ELEMENT_FN void lamb_apply(F& p, F m, F v, float ratio, const LambStep& s) {
  lamb_apply_update(p, lamb_direction(m, v, p, s), ratio);
}

}  // namespace ampfuse::kernels
