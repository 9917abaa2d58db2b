// Bit-exact fp16/bf16 <-> fp32 conversions for the CPU kernels, written without
// branches so that loops over them vectorize. They round to nearest-even and
// agree bit for bit with torch's c10::Half and c10::BFloat16 (the tests check
// every fp16 value). They rely on IEEE float arithmetic: never build these with
// -ffast-math.
#pragma once

#include <cstdint>

namespace ampfuse::kernels::cpu {

// __builtin_bit_cast rather than memcpy: GCC if-converts and vectorizes loops
// over it, where a memcpy left "control flow in loop".
inline float bits_to_float(std::uint32_t u) { return __builtin_bit_cast(float, u); }

inline std::uint32_t float_to_bits(float f) { return __builtin_bit_cast(std::uint32_t, f); }

// cond ? a : b on bit patterns, spelled with masks: GCC 12 vectorizes this form
// but leaves the ternary as a branch ("control flow in loop").
inline std::uint32_t select_bits(bool cond, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// A float is non-finite exactly when its exponent bits are all ones.
inline bool is_nonfinite(float f) { return (float_to_bits(f) & 0x7f800000u) == 0x7f800000u; }

inline float bf16_to_float(std::uint16_t h) { return bits_to_float(std::uint32_t{h} << 16); }

inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_to_bits(f);
  // Round to nearest even on the 16 dropped bits; NaNs become the canonical quiet NaN
  // (rounding could otherwise carry a NaN's payload into infinity).
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(select_bits(is_nan, 0x7fc0u, rounded));
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t word = std::uint32_t{h} << 16;
  const std::uint32_t sign = word & 0x80000000u;
  const std::uint32_t magnitude = word << 1;  // exponent and mantissa, sign shifted out
  // Normal numbers (and inf/nan): place the 5-bit exponent and mantissa inside a float
  // whose exponent is 112 too large, then scale by 2^-112. Infinity and NaN land on
  // float exponents above 255-112 and so stay inf/nan after the scaling.
  const float normal = bits_to_float((magnitude >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  // Subnormal halves: build 0.5 + m * 2^-24 exactly, then subtract 0.5.
  const float subnormal = bits_to_float((magnitude >> 17) | (126u << 23)) - 0.5f;
  const bool is_subnormal = magnitude < (1u << 27);
  return bits_to_float(sign |
                       select_bits(is_subnormal, float_to_bits(subnormal), float_to_bits(normal)));
}

inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_to_bits(f);
  const std::uint32_t doubled = u + u;  // sign shifted out
  const std::uint32_t sign = u & 0x80000000u;
  // Scale up then down so values beyond half's range overflow to inf and values
  // below it flush the way half rounding does, using the FPU's own rounding.
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  std::uint32_t bias = doubled & 0xff000000u;
  bias = select_bits(bias < 0x71000000u, 0x71000000u, bias);
  // Adding a power of two 2^13 times larger than one half-ulp of f shifts f's mantissa so
  // the float addition itself rounds it to half's 10 bits, to nearest even.
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t b = float_to_bits(base);
  const std::uint32_t exponent_bits = (b >> 13) & 0x7c00u;
  const std::uint32_t mantissa_bits = b & 0x0fffu;
  const std::uint32_t magnitude = exponent_bits + mantissa_bits;
  const bool is_nan = doubled > 0xff000000u;
  return static_cast<std::uint16_t>((sign >> 16) | select_bits(is_nan, 0x7e00u, magnitude));
}

// Uniform load/store of one element as float, for kernels templated on storage type.
template <typename Storage>
struct Element;

template <>
struct Element<float> {
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

struct Fp16Bits {
  std::uint16_t bits;
};
struct Bf16Bits {
  std::uint16_t bits;
};

template <>
struct Element<Fp16Bits> {
  static float load(Fp16Bits x) { return fp16_to_float(x.bits); }
  static Fp16Bits store(float x) { return {float_to_fp16(x)}; }
};

template <>
struct Element<Bf16Bits> {
  static float load(Bf16Bits x) { return bf16_to_float(x.bits); }
  static Bf16Bits store(float x) { return {float_to_bf16(x)}; }
};

}  // namespace ampfuse::kernels::cpu
