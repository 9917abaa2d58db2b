// Whether this library's GPU code can run on a device. Plain C++, no CUDA headers, so the op
// layer includes it in any build.
#pragma once

namespace ampfuse::kernels::cuda {

struct DeviceImage {
  // 0 (cudaSuccess) when the CUDA runtime found code for the device in this library: an
  // image for its architecture, or PTX it could compile. Else the runtime's error code.
  int error = 0;
  const char* error_name = "";  // cudaGetErrorName(error)
  int major = 0;                // the device's compute capability
  int minor = 0;
  char name[256] = {};  // the device's name, e.g. "Tesla T4"
};

// Asks the CUDA runtime for a kernel of this library on `device`, as a launch would (with
// lazy loading, this is what loads or JIT-compiles its module). Never throws; leaves no CUDA
// error pending.
DeviceImage probe_device_image(int device);

}  // namespace ampfuse::kernels::cuda
