// The CUDA context an op launches in: a device guard for the tensors' device and
// that device's current stream (so ampfuse work orders itself with the caller's).
#pragma once

#ifdef AMPFUSE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/dtype.h"

namespace ampfuse::ops {

inline kernels::StreamHandle current_stream(const at::Device& device) {
  return reinterpret_cast<kernels::StreamHandle>(
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

}  // namespace ampfuse::ops
#endif
