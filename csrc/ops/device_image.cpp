// The first CUDA call of any op on a device checks that this library has GPU code for it, so a
// GPU the build does not cover gets an error that names it and the fix, instead of a CUDA
// "no kernel image" fault from the middle of a launch sequence.
#ifdef AMPFUSE_WITH_CUDA
#include "../kernels/device_image.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstring>

#include "cuda_context.h"

// What CMake compiled the .cu files for, e.g. "sm_75, sm_80, sm_120 + PTX compute_120".
#ifndef AMPFUSE_CUDA_ARCHITECTURES
#error "CMakeLists.txt defines AMPFUSE_CUDA_ARCHITECTURES for the op library"
#endif

namespace ampfuse::ops {
namespace {

bool is_missing_image(const char* error_name) {
  return std::strcmp(error_name, "cudaErrorNoKernelImageForDevice") == 0 ||
         std::strcmp(error_name, "cudaErrorInvalidDeviceFunction") == 0;
}

void check_device_image(int device) {
  const kernels::cuda::DeviceImage image = kernels::cuda::probe_device_image(device);
  if (image.error == 0) return;
  const int major = image.major;
  const int minor = image.minor;
  TORCH_CHECK(!is_missing_image(image.error_name), "ampfuse has no GPU code for CUDA device ",
              device, " (", image.name, ", compute capability ", major, ".", minor, ", sm_", major,
              minor, "): this build holds code for ", AMPFUSE_CUDA_ARCHITECTURES,
              ", none of which runs on it (", image.error_name,
              "). Rebuild ampfuse for this GPU "
              "in its source folder: TORCH_CUDA_ARCH_LIST=\"",
              major, ".", minor,
              "\" pip install --no-build-isolation . ; `python -m ampfuse doctor` shows what a "
              "build holds.");
  TORCH_CHECK(false, "ampfuse's GPU code could not be loaded on CUDA device ", device, " (",
              image.name, ", compute capability ", major, ".", minor, "): ", image.error_name,
              ". The build holds code for ", AMPFUSE_CUDA_ARCHITECTURES,
              ". A PTX error means "
              "the NVIDIA driver is older than the CUDA toolkit that compiled ampfuse: update the "
              "driver. `python -m ampfuse doctor` checks the installation.");
}

}  // namespace

void require_device_image(const at::Device& device) {
  // One flag per device index; two threads racing on the first call both probe, which is
  // harmless (the probe has no side effects beyond loading the module).
  static std::array<std::atomic<bool>, 64> checked{};
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  if (index < static_cast<int>(checked.size()) && checked[index].load(std::memory_order_acquire)) {
    return;
  }
  check_device_image(index);
  if (index < static_cast<int>(checked.size())) {
    checked[index].store(true, std::memory_order_release);
  }
}

}  // namespace ampfuse::ops
#endif
