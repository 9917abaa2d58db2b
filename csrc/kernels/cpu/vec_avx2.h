// Eight elements of any storage type loaded as, and stored from, one AVX register of
// floats, using the F16C instructions for fp16. Every function here is compiled for
// AVX2+F16C through a target attribute, not a build flag, so this header can be included
// by baseline code; it may only run where cpu_has_avx2_f16c() is true.
//
// Stores round exactly as half_convert.h does (to nearest even; NaN becomes the same
// canonical NaN), so a kernel gives the same bits on every CPU, with or without F16C.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AMPFUSE_HAVE_AVX2_PATH 1

#include <immintrin.h>

#include <cstdint>

#include "half_convert.h"

#define AMPFUSE_AVX2 __attribute__((target("avx2,f16c")))

namespace ampfuse::kernels::cpu {

// Asked once; libgcc's answer also checks that the OS saves the AVX registers.
inline bool cpu_has_avx2_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

// All ones in each lane whose float is inf or nan (exponent bits all set).
AMPFUSE_AVX2 inline __m256i nonfinite_lanes(__m256 x) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), exponent), exponent);
}

template <typename Storage>
struct Vec8;

template <>
struct Vec8<float> {
  AMPFUSE_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  AMPFUSE_AVX2 static void store(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
};

template <>
struct Vec8<Fp16Bits> {
  AMPFUSE_AVX2 static __m256 load(const Fp16Bits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  AMPFUSE_AVX2 static void store(Fp16Bits* p, __m256 x) {
    // vcvtps2ph keeps a NaN's payload; c10 (and float_to_fp16) write sign | 0x7e00.
    // A float NaN with an empty payload converts to exactly that.
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 sign = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
    const __m256 quiet_nan = _mm256_or_ps(sign, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    x = _mm256_blendv_ps(x, quiet_nan, is_nan);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
};

template <>
struct Vec8<Bf16Bits> {
  AMPFUSE_AVX2 static __m256 load(const Bf16Bits* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  AMPFUSE_AVX2 static void store(Bf16Bits* p, __m256 x) {
    // float_to_bf16, eight lanes at a time: round to nearest even on the dropped 16 bits,
    // NaN becomes 0x7fc0.
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    // Lanes hold values below 2^16, so the unsigned saturating pack is exact.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

}  // namespace ampfuse::kernels::cpu

#endif
