// The per-element Adagrad update (Duchi et al., 2011), written once for the CPU and CUDA kernels:
// torch.optim.Adagrad's arithmetic (the order of its foreach ops: an L2 decay added to the grad,
// sum += g * g, param += (-clr * g) / (sqrt(sum) + eps) with clr = lr / (1 + (t - 1) * lr_decay)),
// whose math apex.optimizers.FusedAdagrad's default mode shares (apex rounds p - lr * (g / d)
// where torch rounds p + (-clr * g) / d: the last bit may differ), and apex's adagrad_w_mode,
// which decays the param outside the adaptive step: p -= lr * (g / (sqrt(sum) + eps) + decay * p)
// (without weight decay the two modes are one, torch's rounding).
#pragma once

#include <cmath>

#include "optimizer_math.h"

namespace ampfuse::kernels {

struct AdagradConfig {
  double lr_decay;
  double weight_decay;
  double eps;
  bool decoupled;  // apex's adagrad_w_mode: decay outside the adaptive step
  bool maximize;
};

// Per-step constants, derived once per call: on the CPU by the op, on CUDA by a one-thread
// prologue from the device-side step count and lr. torch forms clr in Python (double); so do
// these, rounding once.
struct AdagradStep {
  float clr;  // lr / (1 + steps_taken * lr_decay)
  float decay;
  float eps;
  float grad_scale;  // the loss scale the grads carry (1 when none)
  bool l2;           // decay != 0 and not decoupled: decay * p joins the grad
  bool decoupled;    // decay != 0 and decoupled: decay * p joins the step
  bool maximize;
  float steps_taken;
};

AMPFUSE_HOST_DEVICE inline AdagradStep make_step_constants(const AdagradConfig& c,
                                                           float steps_taken, float lr,
                                                           float grad_scale) {
  AdagradStep s;
  // mul(): nvcc would fuse 1 + t * lr_decay into one FMA, rounding clr differently from the CPU
  // (and torch) for some steps.
  s.clr = static_cast<float>(static_cast<double>(lr) /
                             (1.0 + mul(static_cast<double>(steps_taken), c.lr_decay)));
  s.decay = static_cast<float>(c.weight_decay);
  s.eps = static_cast<float>(c.eps);
  s.grad_scale = grad_scale;
  s.l2 = !c.decoupled && s.decay != 0.0f;
  s.decoupled = c.decoupled && s.decay != 0.0f;
  s.maximize = c.maximize;
  s.steps_taken = steps_taken;
  return s;
}

// One element: p the fp32 param (its master when there is one), g the unscaled grad, sum the
// running sum of squared grads.
template <typename F>
AMPFUSE_ELEMENT_FN void adagrad_update(F& p, F g, F& sum, const AdagradStep& s) {
  g = choose(s.maximize, -g, g);
  g = choose(s.l2, g + mul(s.decay, p), g);
  sum = sum + mul(g, g);
  const F denom = square_root(sum) + s.eps;
  if (s.decoupled) {
    p = p - mul(s.clr, g / denom + mul(s.decay, p));
  } else {
    p = p + mul(-s.clr, g) / denom;
  }
}

}  // namespace ampfuse::kernels
