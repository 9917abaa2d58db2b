// Device buffers for the CUDA kernel tests (host code: the CUDA runtime API only): a tensor of
// raw element bits with its device copy, an optimizer's param, grad and first moment viewed
// part of the way into theirs, a device array and a device scalar; and a comparison of floats in
// units in the last place. Every CUDA call is a REQUIRE.
#pragma once

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
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

// One optimizer tensor's param, grad and fp32 first moment, `n` elements viewed `offset`
// elements into their allocations (an offset of 1 breaks 16-byte alignment: the kernels' scalar
// path); the optimizer's own state comes in a derived slot. The params are uniform in [-1, 1),
// the grads in [-grad_bound, grad_bound) and the moments in [-0.1, 0.1), from seed, seed + 1
// and seed + 2.
struct OptimizerSlot {
  std::int64_t n;
  std::int64_t offset;
  DeviceTensor param, grad, m;

  OptimizerSlot(DType param_dtype, DType grad_dtype, std::int64_t size, std::int64_t off,
                std::uint32_t seed, float grad_bound)
      : n(size),
        offset(off),
        param(param_dtype, size + off, seed, -1.0f, 1.0f),
        grad(grad_dtype, size + off, seed + 1, -grad_bound, grad_bound),
        m(DType::kFloat32, size + off, seed + 2, -0.1f, 0.1f) {}

  // The view of one of the slot's tensors on the device, and in a host copy of its bits.
  TensorRef at(DeviceTensor& t) const {
    return {static_cast<char*>(t.device) + offset * element_size(t.dtype), n, t.dtype};
  }
  unsigned char* host_at(std::vector<unsigned char>& h, DType dtype) const {
    return h.data() + offset * element_size(dtype);
  }
};

// Every tensor's device bits, slot after slot, each slot's in the order of its tensors().
template <typename Slot>
std::vector<std::vector<unsigned char>> download_slots(
    const std::vector<std::unique_ptr<Slot>>& slots) {
  std::vector<std::vector<unsigned char>> out;
  for (const auto& s : slots) {
    for (const DeviceTensor* t : s->tensors()) out.push_back(t->download());
  }
  return out;
}

// Device scratch of n elements of T (at least one, so an empty list still gets a pointer),
// left uninitialized.
template <typename T>
struct DeviceArray {
  T* device = nullptr;
  explicit DeviceArray(std::int64_t n) {
    check(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(T) * (n > 0 ? n : 1)));
  }
  DeviceArray(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(device); }
};

template <typename T>
std::vector<T> download_array(const T* device, std::size_t n) {
  std::vector<T> out(n);
  check(cudaMemcpy(out.data(), device, sizeof(T) * n, cudaMemcpyDeviceToHost));
  return out;
}

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

// Whether two floats are within `ulps` units in the last place: their bit patterns mapped onto
// one ordered integer line (so -0 and +0 are 0 apart).
inline bool floats_within_ulps(float a, float b, std::int64_t ulps) {
  const auto ordered = [](float x) -> std::int64_t {
    std::uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const std::int64_t magnitude = bits & 0x7fffffffu;
    return bits & 0x80000000u ? -magnitude : magnitude;
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return (d < 0 ? -d : d) <= ulps;
}

}  // namespace ampfuse::kernels::test
