// update_scale_: the dynamic loss-scale rule on device scalars, one thread, so
// the scale never travels to the host.
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "scale_rule.h"

namespace ampfuse::kernels::cuda {
namespace {

__global__ void update_scale_kernel(float* scale, std::int32_t* growth_tracker,
                                    std::int32_t* hysteresis_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor,
                                    std::int64_t growth_interval, std::int64_t hysteresis,
                                    double min_scale, double max_scale) {
  apply_scale_rule(scale, growth_tracker, hysteresis_tracker, *found_inf, growth_factor,
                   backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace

void update_scale(float* scale, std::int32_t* growth_tracker, std::int32_t* hysteresis_tracker,
                  const float* found_inf, double growth_factor, double backoff_factor,
                  std::int64_t growth_interval, std::int64_t hysteresis, double min_scale,
                  double max_scale, StreamHandle stream) {
  update_scale_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale);
  throw_on_launch_error("update_scale_");
}

}  // namespace ampfuse::kernels::cuda
