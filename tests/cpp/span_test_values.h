// Values for the tests of the CPU span kernels (cpu_kernels.h) in each storage type, and bitwise
// comparisons of them.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "dtype.h"

namespace ampfuse::kernels::test {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// A loss scale that is not a power of two, so that unscaling rounds: the kernels divide, as
// torch does, and multiplying by 1 / scale would give other bits.
constexpr float kGradScale = 384.0f;

// How far a float computation of a few roundings may stray from float64, relative to the sum
// of the magnitudes of its terms (so a cancellation does not need a looser bound).
constexpr double kRelative = 1e-6;

// Normally distributed around 0, `scale` the standard deviation.
inline std::vector<float> random_floats(std::int64_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// Values stored in `Storage` and read back: what the kernels see of a low-precision tensor.
template <typename Storage>
std::vector<Storage> stored(const std::vector<float>& x) {
  std::vector<Storage> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = cpu::Element<Storage>::store(x[i]);
  return out;
}

template <typename Storage>
DType dtype_of();
template <>
inline DType dtype_of<float>() {
  return DType::kFloat32;
}
template <>
inline DType dtype_of<cpu::Fp16Bits>() {
  return DType::kFloat16;
}
template <>
inline DType dtype_of<cpu::Bf16Bits>() {
  return DType::kBFloat16;
}

template <typename Storage>
const char* name_of() {
  return dtype_of<Storage>() == DType::kFloat32   ? "fp32"
         : dtype_of<Storage>() == DType::kFloat16 ? "fp16"
                                                  : "bf16";
}

template <typename Storage>
bool same_bits(const Storage& a, const Storage& b) {
  return std::memcmp(&a, &b, sizeof(Storage)) == 0;
}

template <typename Storage>
bool same_bytes(const std::vector<Storage>& a, const std::vector<Storage>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Storage)) == 0;
}

}  // namespace ampfuse::kernels::test
