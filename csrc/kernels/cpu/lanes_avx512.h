// Sixteen fp32 lanes with AVX-512: storage (fp32, fp16, bf16) to and from Lanes16 with
// vec_avx2.h's Vec8 bits, and the bf16 modes' 16-bit words (bf16_lanes.h's Words policies). The
// sixteen-lane Adam kernels (optimizer_kernels_avx512.cpp, adam_coded_avx512.cpp) run the shared
// 8-lane loop templates at this width. Where the processor runs zmm instructions at full width
// (AMD Zen 5, Intel server cores) a vector division or square root costs about what its ymm form
// costs, so sixteen lanes nearly halve the arithmetic of a step that is bound by it. Call only
// where cpu_has_avx512().
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define AMPFUSE_HAVE_AVX512_PATH 1

#include <immintrin.h>

#include <cstdint>

#include "bf16_lanes.h"
#include "half_convert.h"
#include "lanes8.h"

#define AMPFUSE_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// Inlined into callers compiled for the same target.
#define AMPFUSE_AVX512 AMPFUSE_AVX512_TARGET __attribute__((always_inline)) inline

namespace ampfuse::kernels::cpu {

// Asked once: AVX-512 F, BW (byte and word lanes), VL and DQ, and AVX2, FMA and F16C, whose
// eight-lane pieces the sixteen-lane kernels share (libgcc's answer also checks that the OS saves
// the zmm registers).
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace ampfuse::kernels::cpu

namespace ampfuse::kernels::cpu::avx512 {

AMPFUSE_AVX512 __m512 broadcast(float x) { return _mm512_set1_ps(x); }
AMPFUSE_AVX512 __m512i broadcast_bits(std::uint32_t x) {
  return _mm512_set1_epi32(static_cast<int>(x));
}
AMPFUSE_AVX512 __m512 as_float(__m512i x) { return _mm512_castsi512_ps(x); }
AMPFUSE_AVX512 __m512i as_bits(__m512 x) { return _mm512_castps_si512(x); }
AMPFUSE_AVX512 __m512 to_vec(Lanes16 x) { return reinterpret_cast<__m512>(x.v); }
AMPFUSE_AVX512 Lanes16 to_lanes(__m512 x) { return Lanes16(reinterpret_cast<Float16>(x)); }

// --- storage ---

// Sixteen elements of a storage type as Lanes16, with vec_avx2.h's rounding on the way out.
// Not forced inline (as Vec8): the target-free loop templates that call them inline them once
// they sit in an AVX-512 function.
template <typename Storage>
struct Lanes512;

template <>
struct Lanes512<float> {
  AMPFUSE_AVX512_TARGET static Lanes16 load(const float* p) { return to_lanes(_mm512_loadu_ps(p)); }
  AMPFUSE_AVX512_TARGET static void store(float* p, Lanes16 x) { _mm512_storeu_ps(p, to_vec(x)); }
};

template <>
struct Lanes512<Fp16Bits> {
  AMPFUSE_AVX512_TARGET static Lanes16 load(const Fp16Bits* p) {
    return to_lanes(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  AMPFUSE_AVX512_TARGET static void store(Fp16Bits* p, Lanes16 lanes) {
    // A NaN becomes sign | 0x7e00, as in Vec8<Fp16Bits>: a float NaN with an empty payload.
    __m512 x = to_vec(lanes);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i sign = _mm512_and_si512(as_bits(x), broadcast_bits(0x80000000u));
    x = _mm512_mask_blend_ps(is_nan, x,
                             as_float(_mm512_or_si512(sign, broadcast_bits(0x7fc00000u))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <>
struct Lanes512<Bf16Bits> {
  AMPFUSE_AVX512_TARGET static Lanes16 load(const Bf16Bits* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return to_lanes(as_float(_mm512_slli_epi32(wide, 16)));
  }
  AMPFUSE_AVX512_TARGET static void store(Bf16Bits* p, Lanes16 lanes) {
    // Round to nearest even on the dropped 16 bits; NaN becomes 0x7fc0 (float_to_bf16).
    const __m512 x = to_vec(lanes);
    const __m512i u = as_bits(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), broadcast_bits(1u));
    const __m512i bias = _mm512_add_epi32(broadcast_bits(0x7fffu), odd);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i words = _mm512_mask_blend_epi32(is_nan, rounded, broadcast_bits(0x7fc0u));
    // Lanes hold values below 2^16: the truncating narrow keeps them whole.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(words));
  }
};

// The bf16 modes' 16-bit words (bf16_lanes.h's Words policies), sixteen at a time.
struct Avx512Words {
  typedef Lanes16 Lanes;
  typedef Words16 Vec;
  static AMPFUSE_AVX512_TARGET Words16 widen(const std::uint16_t* p) {
    return reinterpret_cast<Words16>(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static AMPFUSE_AVX512_TARGET Words16 widen_signed(const std::uint16_t* p) {
    return reinterpret_cast<Words16>(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static AMPFUSE_AVX512_TARGET void store_low_halves(std::uint16_t* p, Words16 u) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(u)));
  }
};

}  // namespace ampfuse::kernels::cpu::avx512

#endif
