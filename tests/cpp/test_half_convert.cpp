// The CPU half conversions against the compiler's own IEEE _Float16 and a
// plain round-to-nearest-even reference for bfloat16.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "cpu/half_convert.h"

using namespace ampfuse::kernels::cpu;

namespace {

// bf16 by the definition: keep the top 16 bits, round the rest to nearest, ties to even.
std::uint16_t bf16_reference(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const std::uint32_t u = float_to_bits(f);
  const std::uint32_t upper = u >> 16, lower = u & 0xffffu;
  const bool round_up = lower > 0x8000u || (lower == 0x8000u && (upper & 1u));
  return static_cast<std::uint16_t>(upper + (round_up ? 1u : 0u));
}

std::uint16_t half_bits(_Float16 h) {
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || float_to_bits(a) == float_to_bits(b);
}

}  // namespace

TEST_CASE("fp16 to float is exact for all 65536 bit patterns") {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    _Float16 h;
    const auto b = static_cast<std::uint16_t>(bits);
    std::memcpy(&h, &b, 2);
    INFO("fp16 bits " << bits);
    REQUIRE(same_float(fp16_to_float(b), static_cast<float>(h)));
  }
}

TEST_CASE("float to fp16 rounds like IEEE round-to-nearest-even") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) {
    const float f = bits_to_float(any_bits(rng));
    const std::uint16_t expected = half_bits(static_cast<_Float16>(f));
    const std::uint16_t got = float_to_fp16(f);
    INFO("float bits " << float_to_bits(f));
    if (std::isnan(f)) {
      REQUIRE((got & 0x7c00u) == 0x7c00u);
      REQUIRE((got & 0x03ffu) != 0u);
    } else {
      REQUIRE(got == expected);
    }
  }
  // Every fp16 value and every midpoint between neighbours (the ties) round trips as IEEE says.
  for (std::uint32_t bits = 0; bits < 0x7c00u; ++bits) {
    const float lo = fp16_to_float(static_cast<std::uint16_t>(bits));
    const float hi = fp16_to_float(static_cast<std::uint16_t>(bits + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    REQUIRE(float_to_fp16(lo) == bits);
    REQUIRE(float_to_fp16(mid) == half_bits(static_cast<_Float16>(mid)));
    REQUIRE(float_to_fp16(-mid) == half_bits(static_cast<_Float16>(-mid)));
  }
  REQUIRE(float_to_fp16(65520.0f) == 0x7c00u);  // rounds up to inf
  REQUIRE(float_to_fp16(65519.99f) == 0x7bffu);  // largest finite half
}

TEST_CASE("bf16 conversions") {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float f = bf16_to_float(static_cast<std::uint16_t>(bits));
    REQUIRE(float_to_bits(f) == bits << 16);
  }
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) {
    const float f = bits_to_float(any_bits(rng));
    INFO("float bits " << float_to_bits(f));
    REQUIRE(float_to_bf16(f) == bf16_reference(f));
  }
  REQUIRE(float_to_bf16(std::numeric_limits<float>::max()) == 0x7f80u);  // rounds to inf
  REQUIRE(float_to_bf16(bits_to_float(0x3f808000u)) == 0x3f80u);          // tie to even
  REQUIRE(float_to_bf16(bits_to_float(0x3f818000u)) == 0x3f82u);          // tie to even, up
}
