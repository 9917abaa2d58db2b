// The CUDA context an op launches in: a device guard for the tensors' device and
// that device's current stream (so ampfuse work orders itself with the caller's). Every CUDA op
// asks for the stream before its first launch, so that is where a device the build has no
// code for is refused (device_image.cpp).
#pragma once

#ifdef AMPFUSE_WITH_CUDA
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/dtype.h"

namespace ampfuse::ops {

// Throws, naming the device and the rebuild command, when this library has no GPU code that
// runs on `device`; checked once per device.
void require_device_image(const at::Device& device);

inline kernels::StreamHandle current_stream(const at::Device& device) {
  require_device_image(device);
  return reinterpret_cast<kernels::StreamHandle>(
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

// The CUDA optimizer kernels read and advance the step count on the GPU. With params, the
// argument checks already put step there; with an empty list only step is left to say.
inline void check_cuda_step(const char* op, const at::Tensor& step) {
  TORCH_CHECK(step.is_cuda(), "ampfuse.", op, ": step is on ", step.device(),
              " but the call has CUDA tensors; move step (and lr, grad_scale, found_inf) to the "
              "CUDA device of the params.");
}

// Device memory for one launch sequence's step constants (written by its prologue kernel),
// from torch's caching allocator: no host sync, and CUDA graph capture takes it from the
// graph's pool.
template <typename Constants>
at::Tensor step_constants_buffer(const at::Device& device) {
  return at::empty({static_cast<std::int64_t>(sizeof(Constants))},
                   at::TensorOptions().device(device).dtype(at::kByte));
}

}  // namespace ampfuse::ops
#endif
