// Block-wise 8-bit codes of Adam's moments (state_dtype "int8" / "fp8"), written once for the
// CPU and CUDA kernels so both produce the bits of the plain-torch reference
// (python/ampfuse/optimizers/_state_codes.py, whose docstring explains the format and why
// the second moment is coded as sqrt(v) in a nonlinear code).
//
// Every value is normalised by its block's absmax and every decode multiplies by the absmax
// last, in fp32 and with the operations in the reference's order: a division and a multiply,
// rounding to nearest even throughout. The decode's products are mul_rn, never contracted into
// an FMA: there is no a*b+c here, but the fused CUDA Adam (adam_coded.cu) inlines a decode into
// adam_update, whose `g - m` and `m + w * (g - m)` nvcc would fuse with a plain `* absmax`
// (one rounding where the CPU, which stores the decoded moment first, rounds twice).
#pragma once

#include <cmath>
#include <cstdint>

#include "fp8_math.h"

#if defined(__CUDACC__)
#define AMPFUSE_CODES_HD __host__ __device__ __forceinline__
#else
#define AMPFUSE_CODES_HD inline
#endif

namespace ampfuse::kernels {

// Elements per quantization block; a block never spans two params.
constexpr int kStateBlock = 256;

enum class StateCode : std::int8_t { kInt8, kFp8 };

namespace state_codes_detail {

AMPFUSE_CODES_HD float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // the default rounding mode is to nearest, ties to even
#endif
}

// 2^e for e in [-19, -4] (the exponents the unsigned code needs), built from its bits.
AMPFUSE_CODES_HD float pow2(int e) {
  return fp8_detail::float_of(static_cast<std::uint32_t>(e + 127) << 23);
}

}  // namespace state_codes_detail

// The signed linear int8 code of a first-moment value x/absmax (in [-1, 1]).
AMPFUSE_CODES_HD std::int8_t encode_linear_int8(float normalised) {
  float q = state_codes_detail::round_half_even(normalised * 127.0f);
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<std::int8_t>(q);
}

AMPFUSE_CODES_HD float decode_linear_int8(std::int8_t code, float absmax) {
  return fp8_detail::mul_rn(static_cast<float>(code) / 127.0f, absmax);
}

// The unsigned e4m4 code (bias 15, subnormals, 1.0 = 0xF0) of sqrt(v)/absmax in [0, 1]. Both
// ranges are formed and one is picked, without a branch, so the CPU loops vectorize.
AMPFUSE_CODES_HD std::uint8_t encode_sqrt_u8(float normalised) {
  const bool subnormal = !(normalised >= 0x1p-14f);
  // Subnormal range: steps of 2^-18; 16 steps is the first normal code, 0x10. (Clamped first,
  // so the conversion is defined for the inputs of the other range too.)
  const float steps = state_codes_detail::round_half_even(
      (normalised < 0x1p-14f ? normalised : 0x1p-14f) * 0x1p18f);
  const int subnormal_code = static_cast<int>(steps);
  const float clamped = normalised > 1.0f ? 1.0f : (subnormal ? 0x1p-14f : normalised);
  std::uint32_t bits = fp8_detail::bits_of(clamped);
  bits = (bits + 0x3ffffu + ((bits >> 19) & 1u)) & ~0x7ffffu;  // 4 mantissa bits, ties to even
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + 15;
  const int normal_code = exponent * 16 + static_cast<int>((bits >> 19) & 0xfu);
  return static_cast<std::uint8_t>(subnormal ? subnormal_code : normal_code);
}

AMPFUSE_CODES_HD float decode_sqrt_u8_unit(std::uint8_t code) {
  const int exponent = code >> 4;
  const float mantissa = static_cast<float>(code & 0xf);
  if (exponent == 0) return mantissa * 0x1p-18f;
  return (16.0f + mantissa) * state_codes_detail::pow2(exponent - 19);
}

// The e4m3 code of a value x/absmax (in [-1, 1]), scaled to e4m3's range.
AMPFUSE_CODES_HD std::uint8_t encode_e4m3_unit(float normalised) {
  return scale_to_fp8<Fp8Format::kE4M3>(normalised, 448.0f);
}

AMPFUSE_CODES_HD float decode_e4m3(std::uint8_t code) {
  const int exponent = (code & 0x7f) >> 3;
  const float mantissa = static_cast<float>(code & 0x7);
  const float magnitude =
      exponent == 0
          ? mantissa * 0x1p-9f
          : (8.0f + mantissa) *
                fp8_detail::float_of(static_cast<std::uint32_t>(exponent - 7 - 3 + 127) << 23);
  return (code & 0x80) ? -magnitude : magnitude;
}

// One moment element, coded and decoded: `second` is the second moment, coded as sqrt(v).
// Codes are bytes; for int8's first moment the byte is the int8 code's two's complement.
// A nan moment (a nonfinite grad stepped without skip_nonfinite) makes its block's scale nan
// and its codes 0, so the whole block decodes to nan, as an fp32 state would show it.
template <StateCode kCode, bool kSecond>
AMPFUSE_CODES_HD std::uint8_t encode_moment(float coded_value, float absmax) {
  const float safe = absmax == 0.0f ? 1.0f : absmax;  // a nan or inf absmax stays
  const float quotient = coded_value / safe;
  // A nan codes as 0 does: every code below is 0 for +0 (a select, not a branch, so the CPU
  // loops vectorize).
  const float normalised = quotient != quotient ? 0.0f : quotient;
  if constexpr (kCode == StateCode::kFp8) {
    return encode_e4m3_unit(normalised);
  } else if constexpr (kSecond) {
    return encode_sqrt_u8(normalised);
  } else {
    return static_cast<std::uint8_t>(encode_linear_int8(normalised));
  }
}

template <StateCode kCode, bool kSecond>
AMPFUSE_CODES_HD float decode_moment(std::uint8_t code, float absmax) {
  float value;
  if constexpr (kCode == StateCode::kFp8) {
    value = fp8_detail::mul_rn(decode_e4m3(code) / 448.0f, absmax);
  } else if constexpr (kSecond) {
    value = fp8_detail::mul_rn(decode_sqrt_u8_unit(code), absmax);
  } else {
    value = decode_linear_int8(static_cast<std::int8_t>(code), absmax);
  }
  // mul_rn for the square too (see the file comment): the caller may add to v.
  return kSecond ? fp8_detail::mul_rn(value, value) : value;
}

// The value a moment element is coded through (sqrt for the second moment), whose absmax is
// the block's scale.
template <bool kSecond>
AMPFUSE_CODES_HD float coded_value(float moment) {
  return kSecond ? sqrtf(moment) : moment;
}

// A whole block on the host (the CPU kernels and tests): `n` <= kStateBlock moment values
// coded into `codes` with their absmax into `*scale`.
template <StateCode kCode, bool kSecond>
inline void encode_block(const float* moment, int n, std::uint8_t* codes, float* scale) {
  float absmax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(coded_value<kSecond>(moment[i]));
    absmax = (a > absmax || a != a) ? a : absmax;  // a nan stays: nothing compares above it
  }
  for (int i = 0; i < n; ++i) {
    codes[i] = encode_moment<kCode, kSecond>(coded_value<kSecond>(moment[i]), absmax);
  }
  *scale = absmax;
}

template <StateCode kCode, bool kSecond>
inline void decode_block(const std::uint8_t* codes, int n, float scale, float* moment) {
  for (int i = 0; i < n; ++i) moment[i] = decode_moment<kCode, kSecond>(codes[i], scale);
}

}  // namespace ampfuse::kernels
