// The device-image probe (device_image.h). Every .cu of the library is compiled for the same
// architectures, so a kernel of this file runs on a device exactly when all of them do.
#include <cuda_runtime.h>

#include <cstring>

#include "device_image.h"

namespace ampfuse::kernels::cuda {
namespace {

__global__ void image_probe_kernel() {}

}  // namespace

DeviceImage probe_device_image(int device) {
  DeviceImage image;
  int previous = 0;
  const bool restore = cudaGetDevice(&previous) == cudaSuccess && previous != device;
  cudaDeviceProp props{};
  cudaError_t status = cudaGetDeviceProperties(&props, device);
  if (status == cudaSuccess) {
    image.major = props.major;
    image.minor = props.minor;
    std::strncpy(image.name, props.name, sizeof(image.name) - 1);
    status = cudaSetDevice(device);
  }
  if (status == cudaSuccess) {
    cudaFuncAttributes attributes{};
    status = cudaFuncGetAttributes(&attributes, image_probe_kernel);
  }
  image.error = static_cast<int>(status);
  image.error_name = cudaGetErrorName(status);
  if (restore) cudaSetDevice(previous);
  // A missing image is not a sticky error; clear it so torch's next check does not report it.
  cudaGetLastError();
  return image;
}

}  // namespace ampfuse::kernels::cuda
