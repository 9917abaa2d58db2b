// Eight coded moment elements at a time with AVX2 and FMA, giving the bits of state_codes.h's
// element functions: what the span loops of coded_moments_avx2.cpp and the fused Adam step of
// adam_coded_avx2.cpp are made of. Call only where avx2_fma::supported().
//
// Why not state_codes.h's functions in a vectorized loop: those divide per element (by the
// block's absmax when coding, by 127 or 448 when decoding), and a vector division occupies the
// divider for as long as Adam's own square root or division does, so coding both moments made
// the coded step 2-3x the fp32-state step on the CPU (benchmarks/RESULTS.md). Here every such
// quotient is formed on the multiply-add units, exactly:
//
//   q0 = x * r            with r = 1 / d rounded to nearest (one division per block)
//   e  = x - q0 * d       exact, as one FMA (q0 is within an ulp or two of x / d)
//   q  = q0 + e * r       one FMA: the quotient x / d rounded to nearest
//
// This is the correction step of Markstein's division theorem, which makes q the correctly rounded
// quotient when q0 is within an ulp of x / d, r is the correctly rounded reciprocal, and neither
// the residual nor q underflows (see below for the first premise). The underflow proviso is why a
// block codes through it only when its divisor (the absmax) is at least 2^-70: then every quotient
// of 2^-33 or more has an exact residual, and a smaller quotient codes as zero in every format
// whatever its last bits (the smallest nonzero code needs about 2^-19). Other blocks (a tiny, inf
// or nan absmax) run state_codes.h's scalar functions. Decoding divides an int8 code by 127 the
// same way, and an e4m3 code by 448 through two 8-entry tables (see decode8).
// The theorem alone does not carry the claim: it asks for a first quotient within an ulp, and
// q0 = x * r rounded is up to 1.48 ulps off for some pairs (x near 2, r rounded by nearly half an
// ulp; measured 2026-11-29). tests/cpp/test_exact_quotient.cpp does: the correction's last FMA
// rounds x / d plus an error under 2^-45 of it, which can change the rounding only for quotients
// that close to a midpoint between two floats; that test's comment shows those pairs are the
// solutions of a congruence, finds them for every one of the 2^23 divisor significands (about 5e7
// pairs, in a second) and checks each against the division, so every pair of significands is
// covered. It also checks whole binades of dividends for several divisors, and
// test_coded_moments.cpp every code's decoding and blocks at the edges of the vector path against
// state_codes.h's functions.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "../state_codes.h"
#include "lanes8.h"

// Inlined into callers compiled for AVX2+FMA (their own target attribute).
#define AMPFUSE_AVX2_FMA __attribute__((target("avx2,fma"), always_inline)) inline

namespace ampfuse::kernels::cpu::avx2_fma {

// A block whose divisor (its absmax, or 1 for an all-zero block) lies in [2^-70, FLT_MAX] codes
// on the vector path; any other runs state_codes.h's scalar functions (see above).
inline bool vector_divisor(float divisor) {
  return divisor >= 0x1p-70f && divisor <= 0x1.fffffep127f;
}

// x / d rounded to nearest, for a positive d and r = 1/d as in the comment above. A -0 dividend
// comes out +0 (its residual is +0, and +0 + -0 is +0); kKeepSign sets x's sign on the result,
// for the e4m3 codes, whose -0 is a code of its own (every other quotient has its sign already,
// and the other codes are the same for -0 and +0).
template <bool kKeepSign>
AMPFUSE_AVX2_FMA __m256 exact_quotient(__m256 x, __m256 d, __m256 r) {
  const __m256 q0 = _mm256_mul_ps(x, r);
  const __m256 residual = _mm256_fnmadd_ps(q0, d, x);
  const __m256 q = _mm256_fmadd_ps(residual, r, q0);
  if constexpr (kKeepSign) return _mm256_or_ps(q, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)));
  return q;
}

AMPFUSE_AVX2_FMA __m256 broadcast(float x) { return _mm256_set1_ps(x); }
AMPFUSE_AVX2_FMA __m256i broadcast_bits(std::uint32_t x) {
  return _mm256_set1_epi32(static_cast<int>(x));
}
AMPFUSE_AVX2_FMA __m256 as_float(__m256i x) { return _mm256_castsi256_ps(x); }
AMPFUSE_AVX2_FMA __m256i as_bits(__m256 x) { return _mm256_castps_si256(x); }

// Eight codes, zero- or sign-extended to 32 bits.
AMPFUSE_AVX2_FMA __m256i load_codes(const std::uint8_t* p, bool sign_extend) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return sign_extend ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

// Eight 32-bit codes (each in [-128, 255]) stored as their low bytes.
AMPFUSE_AVX2_FMA void store_codes(std::uint8_t* p, __m256i codes, bool is_signed) {
  const __m128i lo = _mm256_castsi256_si128(codes);
  const __m128i hi = _mm256_extracti128_si256(codes, 1);
  // Signed codes saturate through the signed packs (values fit, so nothing saturates), unsigned
  // through the unsigned ones.
  const __m128i words = is_signed ? _mm_packs_epi32(lo, hi) : _mm_packus_epi32(lo, hi);
  const __m128i bytes = is_signed ? _mm_packs_epi16(words, words) : _mm_packus_epi16(words, words);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
}

// Thirty-two 32-bit codes, four vectors in element order, stored as their low bytes: two
// rounds of packs (which interleave the 128-bit halves) and one permute to undo that.
AMPFUSE_AVX2_FMA void store_codes32(std::uint8_t* p, __m256i a, __m256i b, __m256i c, __m256i d,
                                    bool is_signed) {
  const __m256i ab = is_signed ? _mm256_packs_epi32(a, b) : _mm256_packus_epi32(a, b);
  const __m256i cd = is_signed ? _mm256_packs_epi32(c, d) : _mm256_packus_epi32(c, d);
  const __m256i bytes = is_signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  // Dwords now hold a0 b0 c0 d0 | a1 b1 c1 d1 (each 4 codes, halves of a..d): put them in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(bytes, order));
}

// --- decoding: decode_moment's bits ---

template <StateCode kCode, bool kSecond>
AMPFUSE_AVX2_FMA __m256 decode8(const std::uint8_t* codes, __m256 scale) {
  __m256 value;
  if constexpr (kCode == StateCode::kFp8) {
    // decode_e4m3(code) / 448 * scale. A normal magnitude (exponent e >= 1, mantissa m) is
    // (8 + m) * 2^(e-10), and its quotient by 448 is RN((8 + m) / 448) * 2^(e-10) exactly (a
    // power of two commutes with rounding while nothing underflows, and nothing here comes near
    // that): an 8-entry table by m, rescaled by adding e to the exponent bits. A subnormal one,
    // m * 2^-9, is RN(m / 448) * 2^-9, a second table. vpermps reads only the index's low three
    // bits, m, so the 7-bit magnitude is the index. The sign is set after the division, so
    // code 0x80 decodes to -0 as the scalar division of -0 does; the second moment squares it
    // away and skips it.
    const __m256i c = load_codes(codes, false);
    const __m256i magnitude = _mm256_and_si256(c, broadcast_bits(0x7fu));
    const __m256 normal_table = _mm256_setr_ps(
        8.0f / 448.0f * 0x1p-10f, 9.0f / 448.0f * 0x1p-10f, 10.0f / 448.0f * 0x1p-10f,
        11.0f / 448.0f * 0x1p-10f, 12.0f / 448.0f * 0x1p-10f, 13.0f / 448.0f * 0x1p-10f,
        14.0f / 448.0f * 0x1p-10f, 15.0f / 448.0f * 0x1p-10f);
    const __m256 subnormal_table =
        _mm256_setr_ps(0.0f, 1.0f / 448.0f * 0x1p-9f, 2.0f / 448.0f * 0x1p-9f,
                       3.0f / 448.0f * 0x1p-9f, 4.0f / 448.0f * 0x1p-9f, 5.0f / 448.0f * 0x1p-9f,
                       6.0f / 448.0f * 0x1p-9f, 7.0f / 448.0f * 0x1p-9f);
    const __m256i exponent_bits =
        _mm256_and_si256(_mm256_slli_epi32(magnitude, 20), broadcast_bits(0xfu << 23));
    const __m256i normal =
        _mm256_add_epi32(as_bits(_mm256_permutevar8x32_ps(normal_table, magnitude)), exponent_bits);
    const __m256 subnormal = _mm256_permutevar8x32_ps(subnormal_table, magnitude);
    const __m256i is_subnormal = _mm256_cmpgt_epi32(broadcast_bits(8u), magnitude);
    __m256 quotient = _mm256_blendv_ps(as_float(normal), subnormal, as_float(is_subnormal));
    if constexpr (!kSecond) {
      const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 24), broadcast_bits(0x80000000u));
      quotient = as_float(_mm256_or_si256(as_bits(quotient), sign));
    }
    value = _mm256_mul_ps(quotient, scale);
  } else if constexpr (kSecond) {
    // decode_sqrt_u8_unit(code) * scale: a normal code (exponent e >= 1, mantissa m) is
    // (1 + m/16) * 2^(e-15), fp32 bits code << 19 plus 112 << 23; a code below 16 is m * 2^-18.
    const __m256i c = load_codes(codes, false);
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(c, 19), broadcast_bits(112u << 23));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(c), broadcast(0x1p-18f));
    const __m256i is_subnormal = _mm256_cmpgt_epi32(broadcast_bits(16u), c);
    value =
        _mm256_mul_ps(_mm256_blendv_ps(as_float(normal), subnormal, as_float(is_subnormal)), scale);
  } else {
    // code / 127 * scale for the signed code (an integer: never -0).
    const __m256 code = _mm256_cvtepi32_ps(load_codes(codes, true));
    value = _mm256_mul_ps(exact_quotient<false>(code, broadcast(127.0f), broadcast(1.0f / 127.0f)),
                          scale);
  }
  return kSecond ? _mm256_mul_ps(value, value) : value;
}

// --- coding: encode_moment's bits ---

// Eight normalised values to codes as 32-bit lanes. Each is x / absmax for the absmax of x's
// own block, so in [-1, 1] and never nan: the scalar functions' clamps and nan checks would
// change nothing here and are left out.
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX2_FMA __m256i code8(__m256 normalised) {
  if constexpr (kCode == StateCode::kFp8) {
    // scale_to_fp8<kE4M3>(normalised, 448): the product's sign and its magnitude coded as
    // encode_fp8_magnitude does (carry-rounded mantissa for normals, a magic addition for
    // subnormals). No nan reaches here and nothing needs saturating: the product is <= 448.
    const __m256i b = as_bits(_mm256_mul_ps(normalised, broadcast(448.0f)));
    const __m256i a = _mm256_and_si256(b, broadcast_bits(0x7fffffffu));
    const __m256i round =
        _mm256_add_epi32(broadcast_bits((1u << 19) - 1u),
                         _mm256_and_si256(_mm256_srli_epi32(a, 20), broadcast_bits(1u)));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(a, round), 20),
                                            broadcast_bits(120u << 3));
    constexpr std::uint32_t kMagicBits = (128u - 7u - 3u + 23u) << 23;
    const __m256i subnormal =
        _mm256_sub_epi32(as_bits(_mm256_add_ps(as_float(a), as_float(broadcast_bits(kMagicBits)))),
                         broadcast_bits(kMagicBits));
    // a < 2^-6 (the smallest normal e4m3) as a signed compare: both sides are below 2^31.
    const __m256i is_subnormal = _mm256_cmpgt_epi32(broadcast_bits(121u << 23), a);
    const __m256i magnitude = _mm256_blendv_epi8(normal, subnormal, is_subnormal);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), broadcast_bits(0x80u));
    return _mm256_or_si256(sign, magnitude);
  } else if constexpr (kSecond) {
    // encode_sqrt_u8 of a value in [0, 1] (a -0 has come out +0, whose code is the same).
    // Below 2^-14 the code counts steps of 2^-18, RNE(x * 2^18): adding 32, whose ulp is 2^-18,
    // rounds x to that grid, and the sum's bits less 32's count the steps (16 steps, 2^-14, is
    // the first normal code, as in the scalar function). From 2^-14 on it is the e4m4 code of
    // x, a carry-rounded 4-bit mantissa: the rounded bits >> 19 are exponent field * 16 +
    // mantissa, less 112 * 16 for the bias.
    const __m256i bits = as_bits(normalised);
    const __m256i round =
        _mm256_add_epi32(broadcast_bits(0x3ffffu),
                         _mm256_and_si256(_mm256_srli_epi32(bits, 19), broadcast_bits(1u)));
    const __m256i normal_code = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(bits, round), 19), broadcast_bits(112u * 16u));
    const __m256 grid = broadcast(32.0f);
    const __m256i subnormal_code =
        _mm256_sub_epi32(as_bits(_mm256_add_ps(normalised, grid)), as_bits(grid));
    // x < 2^-14 as a signed compare of the bits (both below 2^31).
    const __m256i is_subnormal = _mm256_cmpgt_epi32(broadcast_bits(113u << 23), bits);
    return _mm256_blendv_epi8(normal_code, subnormal_code, is_subnormal);
  } else {
    // encode_linear_int8: x * 127 (within [-127, 127] already) rounded as nearbyint rounds, by
    // the conversion itself (both follow the rounding mode, to nearest even unless changed).
    return _mm256_cvtps_epi32(_mm256_mul_ps(normalised, broadcast(127.0f)));
  }
}

// |x| as bits, whose unsigned max over a block is its absmax (nan above inf), as block_absmax.
AMPFUSE_AVX2_FMA __m256i magnitude_bits(__m256 x) {
  return _mm256_and_si256(as_bits(x), broadcast_bits(0x7fffffffu));
}

// A block's absmax as encode_block finds it, given `top`, the largest magnitude_bits of its first
// `whole` values: the rest are taken one by one, and the result is the largest |x|, or the last
// nan's |nan| when the block holds a nan. Shared by the eight- and sixteen-lane finish_absmax.
inline float finish_absmax_from(std::uint32_t top, const float* values, int whole, int n) {
  for (int i = whole; i < n; ++i) {
    const std::uint32_t b = fp8_detail::bits_of(values[i]) & 0x7fffffffu;
    top = top > b ? top : b;
  }
  if (top > 0x7f800000u) {
    for (int i = n - 1; i >= 0; --i) {
      if (values[i] != values[i]) return std::fabs(values[i]);
    }
  }
  return fp8_detail::float_of(top);
}

// finish_absmax_from with the running max of magnitude_bits over the first `whole` values.
__attribute__((target("avx2,fma"))) inline float finish_absmax(__m256i largest, const float* values,
                                                               int whole, int n) {
  alignas(32) std::uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), largest);
  std::uint32_t top = 0;
  for (const std::uint32_t lane : lanes) top = top > lane ? top : lane;
  return finish_absmax_from(top, values, whole, n);
}

// The codes of values[0, 8) under a block's divisor and its reciprocal.
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX2_FMA __m256i code_at(const float* values, __m256 divisor, __m256 reciprocal) {
  return code8<kCode, kSecond>(
      exact_quotient<kCode == StateCode::kFp8>(_mm256_loadu_ps(values), divisor, reciprocal));
}

// Codes one block's `n` coded values (sqrt(v) for the second moment) whose absmax is `absmax`.
template <StateCode kCode, bool kSecond>
__attribute__((target("avx2,fma"))) inline void code_block(const float* values, int n, float absmax,
                                                           std::uint8_t* codes) {
  const float divisor = absmax == 0.0f ? 1.0f : absmax;  // encode_moment's `safe`
  const int whole = vector_divisor(divisor) ? n - n % 8 : 0;
  if (whole > 0) {
    const __m256 divisor8 = broadcast(divisor);
    const __m256 reciprocal8 = broadcast(1.0f / divisor);
    constexpr bool kSigned = kCode == StateCode::kInt8 && !kSecond;
    const int whole32 = whole - whole % 32;
    for (int i = 0; i < whole32; i += 32) {
      store_codes32(codes + i, code_at<kCode, kSecond>(values + i, divisor8, reciprocal8),
                    code_at<kCode, kSecond>(values + i + 8, divisor8, reciprocal8),
                    code_at<kCode, kSecond>(values + i + 16, divisor8, reciprocal8),
                    code_at<kCode, kSecond>(values + i + 24, divisor8, reciprocal8), kSigned);
    }
    for (int i = whole32; i < whole; i += 8) {
      store_codes(codes + i, code_at<kCode, kSecond>(values + i, divisor8, reciprocal8), kSigned);
    }
  }
  for (int i = whole; i < n; ++i) codes[i] = encode_moment<kCode, kSecond>(values[i], absmax);
}

// The names the loops shared with the sixteen-lane AVX-512 code use (coded_moments_lanes.inc,
// adam_coded_lanes.inc; coded_lanes_avx512.h defines the same for zmm registers).
constexpr int kLanes = 8;
typedef __m256 Vec;
typedef __m256i VecBits;
template <StateCode kCode, bool kSecond>
AMPFUSE_AVX2_FMA __m256 decode_lanes(const std::uint8_t* codes, __m256 scale) {
  return decode8<kCode, kSecond>(codes, scale);
}
AMPFUSE_AVX2_FMA __m256 load_vec(const float* p) { return _mm256_loadu_ps(p); }
AMPFUSE_AVX2_FMA void store_vec(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
AMPFUSE_AVX2_FMA void store_aligned(float* p, __m256 x) { _mm256_store_ps(p, x); }
AMPFUSE_AVX2_FMA __m256 sqrt_vec(__m256 x) { return _mm256_sqrt_ps(x); }
AMPFUSE_AVX2_FMA __m256i zero_bits() { return _mm256_setzero_si256(); }
AMPFUSE_AVX2_FMA __m256i max_bits(__m256i a, __m256i b) { return _mm256_max_epu32(a, b); }
// Between Vec and the lanes the fused loops run on (lanes8.h).
AMPFUSE_AVX2_FMA __m256 to_vec(Lanes8 x) { return reinterpret_cast<__m256>(x.v); }
AMPFUSE_AVX2_FMA Lanes8 to_lanes(__m256 x) { return Lanes8(reinterpret_cast<Float8>(x)); }

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
