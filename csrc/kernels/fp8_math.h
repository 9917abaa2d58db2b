// FP8 arithmetic shared by the CPU and CUDA kernels, written once so both devices produce
// the same bits: the saturating fp32 -> e4m3fn/e5m2 cast, the amax fold, and the
// delayed-scaling rule that turns an amax history into the next scale.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define AMPFUSE_FP8_HD __host__ __device__ __forceinline__
#else
#define AMPFUSE_FP8_HD inline
#endif

namespace ampfuse::kernels {

// torch.float8_e4m3fn (weights, activations) and torch.float8_e5m2 (gradients).
enum class Fp8Format : std::int8_t { kE4M3, kE5M2 };

AMPFUSE_FP8_HD float fp8_max(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
}

namespace fp8_detail {

AMPFUSE_FP8_HD std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(std::uint32_t, f);
#endif
}

AMPFUSE_FP8_HD float float_of(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

// Explicit round-to-nearest products and sums: nvcc would otherwise contract the scale
// multiply and the rounding add below into one FMA, and the device would round differently
// from the CPU (whose kernels are built with -ffp-contract=off).
AMPFUSE_FP8_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

AMPFUSE_FP8_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// IEEE division on both devices (a -use_fast_math build would otherwise approximate it).
AMPFUSE_FP8_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace fp8_detail

// cond ? a : b on bit patterns, spelled with masks: GCC vectorizes this form where a ternary
// stays a branch ("control flow in loop").
AMPFUSE_FP8_HD std::uint32_t select_bits(bool cond, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// The fp8 code (without sign) of a magnitude given as fp32 bits `a` (sign cleared), rounded
// to nearest even, for a value <= fp8_max(format) or nan (callers saturate first). Mantissa
// bits M, exponent bias B:
//  - normal values keep fp32's exponent rebased to B and round the mantissa to M bits with
//    the carry trick (adding 0x7f..f plus the lowest kept bit), a carry into the exponent
//    being the correct result;
//  - values below the smallest normal are rounded by a float addition of a constant whose
//    ulp is the fp8 subnormal step, so the sum's low bits count subnormal steps; rounding
//    up to the smallest normal gives its code as well.
// nan becomes 0x7f, as torch's conversions write it.
template <Fp8Format kFormat>
AMPFUSE_FP8_HD std::uint32_t encode_fp8_magnitude(std::uint32_t a) {
  using fp8_detail::bits_of;
  constexpr int kMantissa = kFormat == Fp8Format::kE4M3 ? 3 : 2;
  constexpr std::uint32_t kBias = kFormat == Fp8Format::kE4M3 ? 7 : 15;
  // Smallest normal 2^(1-B) as fp32 bits, and 2^23 subnormal steps (2^(1-B-M+23)).
  constexpr std::uint32_t kMinNormalBits = (128u - kBias) << 23;
  constexpr std::uint32_t kSubnormalMagicBits = (128u - kBias - kMantissa + 23u) << 23;
  const std::uint32_t round = ((1u << (22 - kMantissa)) - 1u) + ((a >> (23 - kMantissa)) & 1u);
  const std::uint32_t normal = ((a + round) >> (23 - kMantissa)) - ((127u - kBias) << kMantissa);
  const float magic = fp8_detail::float_of(kSubnormalMagicBits);
  const std::uint32_t subnormal =
      bits_of(fp8_detail::add_rn(fp8_detail::float_of(a), magic)) - kSubnormalMagicBits;
  const std::uint32_t code = select_bits(a < kMinNormalBits, subnormal, normal);
  return select_bits(a > 0x7f800000u, 0x7fu, code);
}

// The fp8 code of v (|v| <= fp8_max(format), or nan), with v's sign.
template <Fp8Format kFormat>
AMPFUSE_FP8_HD std::uint8_t encode_fp8(float v) {
  const std::uint32_t b = fp8_detail::bits_of(v);
  return static_cast<std::uint8_t>(((b >> 24) & 0x80u) |
                                   encode_fp8_magnitude<kFormat>(b & 0x7fffffffu));
}

// x * scale saturated to [-fp8_max, fp8_max] and encoded: inf and finite values beyond the
// range become the largest finite code of their sign, nan stays nan. The saturation compares
// magnitudes as bits, whose order is the value order for non-negative floats (nan above inf).
template <Fp8Format kFormat>
AMPFUSE_FP8_HD std::uint8_t scale_to_fp8(float x, float scale) {
  constexpr std::uint32_t kMaxBits = kFormat == Fp8Format::kE4M3 ? 0x43e00000u   // 448
                                                                 : 0x47600000u;  // 57344
  const std::uint32_t b = fp8_detail::bits_of(fp8_detail::mul_rn(x, scale));
  std::uint32_t a = b & 0x7fffffffu;
  a = select_bits((a > kMaxBits) & (a <= 0x7f800000u), kMaxBits, a);
  return static_cast<std::uint8_t>(((b >> 24) & 0x80u) | encode_fp8_magnitude<kFormat>(a));
}

// |x| as bits. For non-negative floats and nan the unsigned order of the bits is the order
// of the values, with every nan above inf: a max over these bits is an amax that propagates
// nan, needs no float compare, and combines across threads with an integer atomicMax.
AMPFUSE_FP8_HD std::uint32_t abs_bits(float x) { return fp8_detail::bits_of(x) & 0x7fffffffu; }

// Current scaling: the scale of a tensor (or of one row or column for rowwise scaling) from
// its own amax, fp8_max / amax / margin_factor in fp32 in that order (margin_factor is
// 2**margin). The rule at the edges:
//  - amax == 0 (an all-zero tensor): scale 1, so zeros stay zeros and scale_inv is 1;
//  - amax inf or nan (the tensor holds a non-finite value): scale nan, so every code of the
//    cast is nan, scale_inv (1 / nan) is nan, and the GEMM output is nan: the loss scaler's
//    overflow check sees it and skips the step, as it would have without FP8;
//  - a quotient beyond fp32's range (a tiny amax, a large margin) is clamped to the largest
//    finite / smallest normal fp32, so scale and scale_inv both stay finite and positive.
AMPFUSE_FP8_HD float current_fp8_scale(float amax, float fp8_max, float margin_factor) {
  const std::uint32_t a = abs_bits(amax);
  const float quotient =
      fp8_detail::div_rn(fp8_detail::div_rn(fp8_max, fp8_detail::float_of(a)), margin_factor);
  constexpr std::uint32_t kLargestFiniteBits = 0x7f7fffffu;
  constexpr std::uint32_t kSmallestNormalBits = 0x00800000u;
  std::uint32_t q = abs_bits(quotient);
  q = q > kLargestFiniteBits ? kLargestFiniteBits : q;
  q = q < kSmallestNormalBits ? kSmallestNormalBits : q;
  if (a == 0u) return 1.0f;
  if (a >= 0x7f800000u) return fp8_detail::float_of(0x7fc00000u);
  return fp8_detail::float_of(q);
}

// Where one FP8 tensor's delayed-scaling state lives (all fp32, on one device).
struct Fp8ScaleState {
  float* amax;     // the step's amax (cast ops fold into it); reset to 0 here
  float* history;  // amax_history_len entries, newest first
  std::int64_t history_len;
  float* scale;      // multiplies the tensor before the cast
  float* scale_inv;  // 1 / scale, handed to the GEMM to undo it
  float fp8_max;     // of the tensor's format
};

// One delayed-scaling update of one tensor's state. Unless `skip` (the step was skipped, so
// its amaxes are dropped): the history moves one slot older, the step's amax goes in
// front, and the amax used is the history's max (use_max) or its newest entry. The new
// scale is fp8_max / amax / 2^margin, computed in fp32 in that order; when that amax is 0,
// inf or nan, or the quotient is not a finite positive number, the old scale stays.
// scale_inv is always rewritten as 1 / scale, and the step's amax is reset to 0 either way.
// The scale half of update_fp8_scale, once the history has been rolled: `amax` is the one the
// rule uses (the history's max or the step's). Shared with the CUDA kernel that rolls a
// history with a whole block (csrc/kernels/fp8_cast.cu).
AMPFUSE_FP8_HD void set_delayed_scale(const Fp8ScaleState& s, float amax, float margin_factor) {
  const float candidate = fp8_detail::div_rn(fp8_detail::div_rn(s.fp8_max, amax), margin_factor);
  const bool usable = amax > 0.0f && abs_bits(amax) < 0x7f800000u &&
                      abs_bits(candidate) < 0x7f800000u && candidate > 0.0f;
  if (usable) *s.scale = candidate;
}

AMPFUSE_FP8_HD void update_fp8_scale(const Fp8ScaleState& s, float margin_factor, bool use_max,
                                     bool skip) {
  const float step_amax = *s.amax;
  *s.amax = 0.0f;
  if (!skip && s.history_len > 0) {
    std::uint32_t largest = abs_bits(step_amax);
    for (std::int64_t i = s.history_len - 1; i > 0; --i) {
      const float older = s.history[i - 1];
      s.history[i] = older;
      const std::uint32_t bits = abs_bits(older);
      largest = bits > largest ? bits : largest;
    }
    s.history[0] = step_amax;
    set_delayed_scale(s, use_max ? fp8_detail::float_of(largest) : step_amax, margin_factor);
  }
  *s.scale_inv = fp8_detail::div_rn(1.0f, *s.scale);
}

}  // namespace ampfuse::kernels
