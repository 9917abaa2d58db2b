// Device buffers for the CUDA kernel tests (host code: the CUDA runtime API only): a tensor of
// raw element bits with its device copy, and a device scalar. Every CUDA call is a REQUIRE.
#pragma once

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "dtype.h"

namespace ampfuse::kernels::test {

inline void check(cudaError_t status) { REQUIRE(status == cudaSuccess); }

// A host buffer of raw element bits, uniform in [lo, hi), and its device copy (16 bytes longer,
// so a test may view it one element in, unaligned).
struct DeviceTensor {
  DType dtype;
  std::int64_t numel;
  std::vector<unsigned char> host;
  void* device = nullptr;

  DeviceTensor(DType d, std::int64_t n, std::uint32_t seed, float lo, float hi)
      : dtype(d), numel(n), host(static_cast<std::size_t>(n * element_size(d))) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (std::int64_t i = 0; i < n; ++i) set(i, dist(rng));
    check(cudaMalloc(&device, host.size() + 16));
    upload();
  }
  // Uniform in [-spread, spread).
  DeviceTensor(DType d, std::int64_t n, std::uint32_t seed, float spread = 100.0f)
      : DeviceTensor(d, n, seed, -spread, spread) {}
  DeviceTensor(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(device); }

  void set(std::int64_t i, float x) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&host[i * 4], &x, 4);
    } else {
      const std::uint16_t h =
          dtype == DType::kFloat16 ? cpu::float_to_fp16(x) : cpu::float_to_bf16(x);
      std::memcpy(&host[i * 2], &h, 2);
    }
  }
  void upload() { check(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice)); }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(host.size());
    check(cudaMemcpy(out.data(), device, out.size(), cudaMemcpyDeviceToHost));
    return out;
  }
  TensorRef ref() { return {device, numel, dtype}; }
};

template <typename T>
struct DeviceScalar {
  T* device = nullptr;
  explicit DeviceScalar(T value) {
    check(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(T)));
    set(value);
  }
  DeviceScalar(const DeviceScalar&) = delete;
  ~DeviceScalar() { cudaFree(device); }
  void set(T value) { check(cudaMemcpy(device, &value, sizeof(T), cudaMemcpyHostToDevice)); }
  T get() const {
    T value;
    check(cudaMemcpy(&value, device, sizeof(T), cudaMemcpyDeviceToHost));
    return value;
  }
};

}  // namespace ampfuse::kernels::test
