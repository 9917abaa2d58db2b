// update_scale_: the dynamic loss-scale rule (csrc/kernels/scale_rule.h) applied to
// device-resident state, so no value is read back to the host.
#include <c10/util/Exception.h>

#include <cmath>

#include "../kernels/cuda_kernels.h"
#include "../kernels/scale_rule.h"
#include "../ops.h"
#include "checks.h"
#include "cuda_context.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kUpdate = "update_scale_";

// update_scale_ on kDevice (see ../ops.h): the checks, then the rule on the CPU or one CUDA
// thread.
template <c10::DeviceType kDevice>
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, std::int64_t growth_interval,
                   std::int64_t hysteresis, double min_scale, double max_scale) {
  const at::Device device = scale.device();
  check_scalar_tensor(kUpdate, scale, "scale", at::kFloat, device);
  check_scalar_tensor(kUpdate, growth_tracker, "growth_tracker", at::kInt, device, "scale");
  check_scalar_tensor(kUpdate, hysteresis_tracker, "hysteresis_tracker", at::kInt, device, "scale");
  check_scalar_tensor(kUpdate, found_inf, "found_inf", at::kFloat, device, "scale");
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor >= 1.0, "ampfuse.", kUpdate,
              ": growth_factor must be a finite number >= 1, got ", growth_factor,
              " (1 keeps the scale from growing).");
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor <= 1.0, "ampfuse.", kUpdate,
              ": backoff_factor must be in (0, 1], got ", backoff_factor, ".");
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= INT32_MAX, "ampfuse.", kUpdate,
              ": growth_interval must be between 1 and 2**31 - 1 steps, got ", growth_interval,
              ".");
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= INT32_MAX, "ampfuse.", kUpdate,
              ": hysteresis must be >= 1 (1 backs off on every overflow), got ", hysteresis, ".");
  TORCH_CHECK(min_scale >= 0.0 && !std::isnan(max_scale) && min_scale <= max_scale, "ampfuse.",
              kUpdate, ": need 0 <= min_scale <= max_scale, got min_scale=", min_scale,
              " and max_scale=", max_scale, ".");
  if constexpr (kDevice == at::kCPU) {
    kernels::apply_scale_rule(scale.data_ptr<float>(), growth_tracker.data_ptr<std::int32_t>(),
                              hysteresis_tracker.data_ptr<std::int32_t>(),
                              *found_inf.data_ptr<float>(), growth_factor, backoff_factor,
                              growth_interval, hysteresis, min_scale, max_scale);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(scale.device());
    kernels::cuda::update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<std::int32_t>(),
                                hysteresis_tracker.data_ptr<std::int32_t>(),
                                found_inf.data_ptr<float>(), growth_factor, backoff_factor,
                                growth_interval, hysteresis, min_scale, max_scale,
                                current_stream(scale.device()));
#endif
  }
}

}  // namespace

OpKernels update_scale_kernels() { return AMPFUSE_KERNELS(update_scale_); }

}  // namespace ampfuse::ops
