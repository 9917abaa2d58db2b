// What the tests of the two implementations of a CPU kernel (portable:: and avx2::, run on the
// same data and required to give the same bits) share: arrays of any dtype as raw bits, values
// with the special cases that tell conversions apart, and the loop over every case.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "cpu/vec_avx2.h"
#include "dtype.h"

namespace ampfuse::kernels::test {

// A signaling NaN with a payload: F16C keeps payloads where the software conversions do not,
// so stores must canonicalize NaN for the two to agree.
const float kPayloadNan = __builtin_bit_cast(float, 0xffa0'1234u);

inline std::uint16_t round_to(DType dtype, float x) {
  if (__builtin_bit_cast(std::uint32_t, x) == __builtin_bit_cast(std::uint32_t, kPayloadNan)) {
    return dtype == DType::kFloat16 ? 0xfd23 : 0xff91;  // payload NaNs of the half types
  }
  return dtype == DType::kFloat16 ? cpu::float_to_fp16(x) : cpu::float_to_bf16(x);
}

// An array of one dtype as raw bytes, so two copies compare with memcmp.
struct Array {
  DType dtype;
  std::vector<float> single;
  std::vector<std::uint16_t> half;

  Array(DType d, const std::vector<float>& values) : dtype(d) {
    if (d == DType::kFloat32) {
      single = values;
    } else {
      for (float x : values) half.push_back(round_to(d, x));
    }
  }
  void* data() {
    return dtype == DType::kFloat32 ? static_cast<void*>(single.data()) : half.data();
  }
};

// Every bit the same, except that a NaN only has to meet a NaN: where two NaNs meet in one
// operation (a NaN or inf param and a NaN grad, say), which of them propagates depends on the
// operand order the compiler chose for that loop, so NaN sign and payload are not compared.
inline bool same_bits(std::uint64_t a, std::uint64_t b, bool a_nan, bool b_nan) {
  return a == b || (a_nan && b_nan);
}

inline bool same(float a, float b) {
  return same_bits(__builtin_bit_cast(std::uint32_t, a), __builtin_bit_cast(std::uint32_t, b),
                   std::isnan(a), std::isnan(b));
}

inline bool same(double a, double b) {
  return same_bits(__builtin_bit_cast(std::uint64_t, a), __builtin_bit_cast(std::uint64_t, b),
                   std::isnan(a), std::isnan(b));
}

inline bool same(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!same(a[i], b[i])) return false;
  }
  return true;
}

inline bool same(const Array& a, const Array& b) {
  if (!same(a.single, b.single) || a.half.size() != b.half.size()) return false;
  // fp16 and bf16 NaNs both have all exponent bits set and a nonzero mantissa.
  const std::uint16_t exponent = a.dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  const auto is_nan = [&](std::uint16_t h) {
    return (h & exponent) == exponent && (h & ~exponent & 0x7fff) != 0;
  };
  for (std::size_t i = 0; i < a.half.size(); ++i) {
    if (!same_bits(a.half[i], b.half[i], is_nan(a.half[i]), is_nan(b.half[i]))) return false;
  }
  return true;
}

// Normal values with fp16 subnormals among them; with `beyond_fp16`, values past fp16's range
// (inf once stored in fp16); with `nonfinite`, inf, -inf, nan and payload nan (in the grads: a
// step the op would skip, run anyway so the kernels' handling of them is compared).
inline std::vector<float> test_values(std::int64_t n, std::uint32_t seed, bool nonfinite,
                                      bool beyond_fp16 = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  if (beyond_fp16) {
    for (std::int64_t i = 5; i < n; i += 97) v[i] *= 1.0e5f;
  }
  for (std::int64_t i = 11; i < n; i += 89) v[i] *= 1.0e-6f;
  if (nonfinite) {
    const float specials[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(), kPayloadNan};
    for (std::int64_t i = 0; i < n; i += 13) v[i] = specials[(i / 13) % 4];
    v[n - 1] = std::numeric_limits<float>::quiet_NaN();  // in the tail of every odd size
  }
  return v;
}

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Whether this CPU can run the avx2:: kernels; where it cannot, a warning says that only the
// portable ones ran, so that a comparison that compared nothing does not pass unnoticed.
inline bool cpu_runs_avx2_kernels() {
  if (cpu::cpu_has_avx2_f16c()) return true;
  WARN("this CPU has no AVX2+F16C: only the portable kernels run here");
  return false;
}
#endif

// Runs both implementations from equal copies of a State, made as State(param_dtype,
// grad_dtype, n, nonfinite), for every (param, grad) dtype pair, size, with and without
// non-finite grads, masters and grad write-back. Three steps, each reading what the last wrote:
// step(use_avx2, state, master, write_grad, n, t) for t = 0, 1, 2; after each, the test's
// same_state(a, b) must hold.
// Around the 8-lane vectors and the 512-element block the F16C kernels once staged through:
// none but 8 and 512 multiples of 8.
inline const std::vector<std::int64_t> kVariantSizes = {1, 7, 8, 9, 23, 511, 512, 513, 1031};

template <typename State, typename Step>
void compare_variants(const char* what, Step&& step,
                      const std::vector<std::int64_t>& sizes = kVariantSizes) {
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (DType param_dtype : dtypes) {
    for (DType grad_dtype : dtypes) {
      for (std::int64_t n : sizes) {
        for (bool nonfinite : {false, true}) {
          for (bool master : {false, true}) {
            for (bool write_grad : {false, true}) {
              State a(param_dtype, grad_dtype, n, nonfinite), b = a;
              INFO(what << ": param " << int(param_dtype) << " grad " << int(grad_dtype) << " n "
                        << n << " nonfinite " << nonfinite << " master " << master << " write_grad "
                        << write_grad);
              for (int t = 0; t < 3; ++t) {
                step(true, a, master, write_grad, n, t);
                step(false, b, master, write_grad, n, t);
                REQUIRE(same_state(a, b));
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace ampfuse::kernels::test
