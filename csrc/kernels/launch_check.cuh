// The check after every kernel launch: a launch that failed (bad configuration, no kernel
// image for this GPU) throws, naming the op, instead of leaving the error to a later call.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace ampfuse::kernels::cuda {

inline void throw_on_launch_error(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("ampfuse: CUDA launch of ") + what +
                             " failed: " + cudaGetErrorString(status));
  }
}

}  // namespace ampfuse::kernels::cuda
