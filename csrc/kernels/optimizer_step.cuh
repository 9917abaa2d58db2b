// Pieces shared by the CUDA optimizer kernels: reading the device-side step
// scalars, skipping on overflow, and advancing the step count afterwards.
#pragma once

#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace ampfuse::kernels::cuda {

__device__ inline bool step_is_skipped(const StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.0f;
}

__device__ inline float grad_factor(const StepScalars& s) {
  return s.grad_scale != nullptr ? 1.0f / *s.grad_scale : 1.0f;
}

// Optional lists travel as copies of the params list so the table keeps a fixed
// depth; the kernel ignores them when the matching flag is off.
inline const std::vector<TensorRef>* or_params(const std::vector<TensorRef>& list,
                                               const std::vector<TensorRef>& params) {
  return list.empty() ? &params : &list;
}

// Runs after the update kernels on the same stream, so they all read the old count.
void advance_step(const StepScalars& scalars, StreamHandle stream);

}  // namespace ampfuse::kernels::cuda
