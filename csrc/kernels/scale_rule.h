// The dynamic loss-scale rule, written once for the host and the device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define AMPFUSE_HOST_DEVICE __host__ __device__
#else
#define AMPFUSE_HOST_DEVICE
#endif

namespace ampfuse::kernels {

// One update of (scale, growth_tracker, hysteresis_tracker) after a step whose
// gradients overflowed (found_inf != 0) or not.
//  - overflow: growth_tracker resets; the scale backs off only on the
//    `hysteresis`-th overflow since the last backoff or growth, and never below
//    min_scale.
//  - clean step: after `growth_interval` clean steps in a row the scale grows,
//    but never to inf (torch's rule) and never above max_scale.
// Products are formed in double and rounded to float, as torch's
// _amp_update_scale_ does, so hysteresis=1, min=0, max=inf reproduces it bit for bit.
AMPFUSE_HOST_DEVICE inline void apply_scale_rule(float* scale, std::int32_t* growth_tracker,
                                                 std::int32_t* hysteresis_tracker, float found_inf,
                                                 double growth_factor, double backoff_factor,
                                                 std::int64_t growth_interval,
                                                 std::int64_t hysteresis, double min_scale,
                                                 double max_scale) {
  const auto hysteresis_reset = static_cast<std::int32_t>(hysteresis);
  if (found_inf != 0.0f) {
    *growth_tracker = 0;
    const std::int32_t remaining = *hysteresis_tracker - 1;
    if (remaining > 0) {
      *hysteresis_tracker = remaining;
      return;
    }
    const auto backed_off = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    const auto floor = static_cast<float>(min_scale);
    *scale = backed_off < floor ? floor : backed_off;
    *hysteresis_tracker = hysteresis_reset;
    return;
  }
  const std::int64_t successful = static_cast<std::int64_t>(*growth_tracker) + 1;
  if (successful < growth_interval) {
    *growth_tracker = static_cast<std::int32_t>(successful);
    return;
  }
  const auto grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
  // grown - grown is 0 for finite values and nan for inf/nan, without <cmath>
  // differences between host and device.
  if (grown - grown == 0.0f) {
    const double ceiling = max_scale;
    *scale = static_cast<double>(grown) > ceiling ? static_cast<float>(ceiling) : grown;
  }
  *growth_tracker = 0;
  *hysteresis_tracker = hysteresis_reset;
}

}  // namespace ampfuse::kernels
