// Decoding and coding the moments sixteen lanes at a time with AVX-512: coded_lanes_avx2.h's
// decode8 / code8 bits with its division-free exact quotients (see there why they are exact and
// when a block needs the scalar functions instead), one zmm register each. What the AVX-512 coded
// Adam step (adam_coded_avx512.cpp) and span loops (coded_moments_avx512.cpp) are made of: the
// coded step moves 16 bytes a param against the fp32-state step's 28, so arithmetic, not memory,
// bounds it, and sixteen lanes nearly halve that (see lanes_avx512.h). Call only where
// cpu_has_avx512().
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "../state_codes.h"
#include "coded_lanes_avx2.h"
#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu::avx512 {

// --- the moments' codes ---

// x / d rounded to nearest for a positive d with r = RN(1 / d): coded_lanes_avx2.h's
// exact_quotient (same preconditions, same -0 handling), sixteen lanes.
template <bool kKeepSign>
AMPFUSE_AVX512 __m512 exact_quotient(__m512 x, __m512 d, __m512 r) {
  const __m512 q0 = _mm512_mul_ps(x, r);
  const __m512 residual = _mm512_fnmadd_ps(q0, d, x);
  const __m512 q = _mm512_fmadd_ps(residual, r, q0);
  if constexpr (kKeepSign) {
    return as_float(
        _mm512_or_si512(as_bits(q), _mm512_and_si512(as_bits(x), broadcast_bits(0x80000000u))));
  }
  return q;
}

// Sixteen codes zero- or sign-extended to 32 bits.
AMPFUSE_AVX512 __m512i load_codes(const std::uint8_t* p, bool sign_extend) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return sign_extend ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}

// Sixteen 32-bit codes (each in [-128, 255]) stored as their low bytes: the truncating narrow
// writes a signed code's two's-complement byte and an unsigned code's byte alike.
AMPFUSE_AVX512 void store_codes(std::uint8_t* p, __m512i codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(codes));
}

// decode_moment's bits for sixteen codes (coded_lanes_avx2.h's decode8 says how each part is
// exact). vpermps of a zmm reads an index's low four bits, so the 8-entry tables are repeated
// twice and the 7-bit magnitude stays the index.
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX512 __m512 decode16(const std::uint8_t* codes, __m512 scale) {
  __m512 value;
  if constexpr (kCode == StateCode::kFp8) {
    const __m512i c = load_codes(codes, false);
    const __m512i magnitude = _mm512_and_si512(c, broadcast_bits(0x7fu));
    // RN((8 + m) / 448) * 2^-10 and RN(m / 448) * 2^-9, as decode8's tables hold them.
    constexpr auto normal_entry = [](int m) { return (8.0f + m) / 448.0f * 0x1p-10f; };
    constexpr auto subnormal_entry = [](int m) { return m / 448.0f * 0x1p-9f; };
    alignas(64) static constexpr float kNormal[16] = {
        normal_entry(0), normal_entry(1), normal_entry(2), normal_entry(3),
        normal_entry(4), normal_entry(5), normal_entry(6), normal_entry(7),
        normal_entry(0), normal_entry(1), normal_entry(2), normal_entry(3),
        normal_entry(4), normal_entry(5), normal_entry(6), normal_entry(7)};
    alignas(64) static constexpr float kSubnormal[16] = {
        subnormal_entry(0), subnormal_entry(1), subnormal_entry(2), subnormal_entry(3),
        subnormal_entry(4), subnormal_entry(5), subnormal_entry(6), subnormal_entry(7),
        subnormal_entry(0), subnormal_entry(1), subnormal_entry(2), subnormal_entry(3),
        subnormal_entry(4), subnormal_entry(5), subnormal_entry(6), subnormal_entry(7)};
    const __m512 normal_table = _mm512_load_ps(kNormal);
    const __m512 subnormal_table = _mm512_load_ps(kSubnormal);
    const __m512i exponent_bits =
        _mm512_and_si512(_mm512_slli_epi32(magnitude, 20), broadcast_bits(0xfu << 23));
    const __m512i normal =
        _mm512_add_epi32(as_bits(_mm512_permutexvar_ps(magnitude, normal_table)), exponent_bits);
    const __m512 subnormal = _mm512_permutexvar_ps(magnitude, subnormal_table);
    const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(magnitude, broadcast_bits(8u));
    __m512 quotient = _mm512_mask_blend_ps(is_subnormal, as_float(normal), subnormal);
    if constexpr (!kSecond) {
      const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(c, 24), broadcast_bits(0x80000000u));
      quotient = as_float(_mm512_or_si512(as_bits(quotient), sign));
    }
    value = _mm512_mul_ps(quotient, scale);
  } else if constexpr (kSecond) {
    const __m512i c = load_codes(codes, false);
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(c, 19), broadcast_bits(112u << 23));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(c), broadcast(0x1p-18f));
    const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(c, broadcast_bits(16u));
    value = _mm512_mul_ps(_mm512_mask_blend_ps(is_subnormal, as_float(normal), subnormal), scale);
  } else {
    const __m512 code = _mm512_cvtepi32_ps(load_codes(codes, true));
    value = _mm512_mul_ps(exact_quotient<false>(code, broadcast(127.0f), broadcast(1.0f / 127.0f)),
                          scale);
  }
  return kSecond ? _mm512_mul_ps(value, value) : value;
}

// code8's bits (coded_lanes_avx2.h) for sixteen normalised values in [-1, 1], never nan.
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX512 __m512i code16(__m512 normalised) {
  if constexpr (kCode == StateCode::kFp8) {
    const __m512i b = as_bits(_mm512_mul_ps(normalised, broadcast(448.0f)));
    const __m512i a = _mm512_and_si512(b, broadcast_bits(0x7fffffffu));
    const __m512i round =
        _mm512_add_epi32(broadcast_bits((1u << 19) - 1u),
                         _mm512_and_si512(_mm512_srli_epi32(a, 20), broadcast_bits(1u)));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(a, round), 20),
                                            broadcast_bits(120u << 3));
    constexpr std::uint32_t kMagicBits = (128u - 7u - 3u + 23u) << 23;
    const __m512i subnormal =
        _mm512_sub_epi32(as_bits(_mm512_add_ps(as_float(a), as_float(broadcast_bits(kMagicBits)))),
                         broadcast_bits(kMagicBits));
    const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(a, broadcast_bits(121u << 23));
    const __m512i magnitude = _mm512_mask_blend_epi32(is_subnormal, normal, subnormal);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), broadcast_bits(0x80u));
    return _mm512_or_si512(sign, magnitude);
  } else if constexpr (kSecond) {
    const __m512i bits = as_bits(normalised);
    const __m512i round =
        _mm512_add_epi32(broadcast_bits(0x3ffffu),
                         _mm512_and_si512(_mm512_srli_epi32(bits, 19), broadcast_bits(1u)));
    const __m512i normal_code = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(bits, round), 19), broadcast_bits(112u * 16u));
    const __m512 grid = broadcast(32.0f);
    const __m512i subnormal_code =
        _mm512_sub_epi32(as_bits(_mm512_add_ps(normalised, grid)), as_bits(grid));
    const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(bits, broadcast_bits(113u << 23));
    return _mm512_mask_blend_epi32(is_subnormal, normal_code, subnormal_code);
  } else {
    return _mm512_cvtps_epi32(_mm512_mul_ps(normalised, broadcast(127.0f)));
  }
}

// |x| as bits, whose unsigned max over a block is its absmax (nan above inf).
AMPFUSE_AVX512 __m512i magnitude_bits(__m512 x) {
  return _mm512_and_si512(as_bits(x), broadcast_bits(0x7fffffffu));
}

// coded_lanes_avx2.h's finish_absmax, from sixteen lanes.
AMPFUSE_AVX512_TARGET inline float finish_absmax(__m512i largest, const float* values, int whole,
                                                 int n) {
  const auto top = static_cast<std::uint32_t>(_mm512_reduce_max_epu32(largest));
  return avx2_fma::finish_absmax_from(top, values, whole, n);
}

// Codes one block's `n` coded values (sqrt(v) for the second moment) whose absmax is `absmax`
// (coded_lanes_avx2.h's code_block).
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX512_TARGET inline void code_block(const float* values, int n, float absmax,
                                             std::uint8_t* codes) {
  const float divisor = absmax == 0.0f ? 1.0f : absmax;  // encode_moment's `safe`
  const int whole = avx2_fma::vector_divisor(divisor) ? n - n % 16 : 0;
  const __m512 divisor16 = broadcast(divisor);
  const __m512 reciprocal16 = broadcast(1.0f / divisor);
  for (int i = 0; i < whole; i += 16) {
    const __m512 q = exact_quotient<kCode == StateCode::kFp8>(_mm512_loadu_ps(values + i),
                                                              divisor16, reciprocal16);
    store_codes(codes + i, code16<kCode, kSecond>(q));
  }
  for (int i = whole; i < n; ++i) codes[i] = encode_moment<kCode, kSecond>(values[i], absmax);
}

// The names of the shared loops (see the end of coded_lanes_avx2.h).
constexpr int kLanes = 16;
typedef __m512 Vec;
typedef __m512i VecBits;
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX512 __m512 decode_lanes(const std::uint8_t* codes, __m512 scale) {
  return decode16<kCode, kSecond>(codes, scale);
}
AMPFUSE_AVX512 __m512 load_vec(const float* p) { return _mm512_loadu_ps(p); }
AMPFUSE_AVX512 void store_vec(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
AMPFUSE_AVX512 void store_aligned(float* p, __m512 x) { _mm512_store_ps(p, x); }
AMPFUSE_AVX512 __m512 sqrt_vec(__m512 x) { return _mm512_sqrt_ps(x); }
AMPFUSE_AVX512 __m512i zero_bits() { return _mm512_setzero_si512(); }
AMPFUSE_AVX512 __m512i max_bits(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }

}  // namespace ampfuse::kernels::cpu::avx512

#endif
