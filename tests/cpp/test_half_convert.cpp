// The CPU half conversions against the compiler's own IEEE _Float16 and a
// plain round-to-nearest-even reference for bfloat16, NaNs as c10 converts them,
// and the AVX2+F16C conversions against the software ones, bit for bit.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/half_convert.h"
#include "cpu/span_variants.h"

using namespace ampfuse::kernels;
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
  REQUIRE(float_to_fp16(65520.0f) == 0x7c00u);   // rounds up to inf
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
  REQUIRE(float_to_bf16(bits_to_float(0x3f808000u)) == 0x3f80u);         // tie to even
  REQUIRE(float_to_bf16(bits_to_float(0x3f818000u)) == 0x3f82u);         // tie to even, up
}

TEST_CASE("NaNs convert as c10 converts them") {
  // fp16 -> float keeps the sign and the payload and sets the quiet bit.
  for (std::uint32_t sign : {0u, 0x8000u}) {
    for (std::uint32_t mantissa = 1; mantissa <= 0x3ffu; ++mantissa) {
      const auto h = static_cast<std::uint16_t>(sign | 0x7c00u | mantissa);
      INFO("fp16 bits " << h);
      REQUIRE(float_to_bits(fp16_to_float(h)) == ((sign << 16) | 0x7fc00000u | (mantissa << 13)));
    }
  }
  // float -> fp16 writes sign | 0x7e00 whatever the payload; float -> bf16 writes 0x7fc0.
  std::mt19937 rng(13);
  std::uniform_int_distribution<std::uint32_t> payload(1, 0x7fffffu);
  for (int i = 0; i < 100000; ++i) {
    const std::uint32_t sign = (i & 1) ? 0x80000000u : 0u;
    const float f = bits_to_float(sign | 0x7f800000u | payload(rng));
    INFO("float bits " << float_to_bits(f));
    REQUIRE(float_to_fp16(f) == ((sign >> 16) | 0x7e00u));
    REQUIRE(float_to_bf16(f) == 0x7fc0u);
  }
}

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

// Floats that exercise every rounding case of a narrowing conversion: random bit patterns,
// every fp16 value and the midpoints around it (ties), and the edges of both formats.
std::vector<float> narrowing_inputs() {
  std::vector<float> v;
  std::mt19937 rng(17);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) v.push_back(bits_to_float(any_bits(rng)));
  for (std::uint32_t bits = 0; bits < 0x7c00u; ++bits) {
    const float lo = fp16_to_float(static_cast<std::uint16_t>(bits));
    const float hi = fp16_to_float(static_cast<std::uint16_t>(bits + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, hi)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  const float edges[] = {0.0f,
                         std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::min(),
                         0x1.0p-25f,  // half of the smallest fp16 subnormal: a tie, to zero
                         0x1.0p-24f,
                         0x1.8p-25f,
                         65504.0f,
                         65519.99f,
                         65520.0f,  // rounds to inf
                         std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::infinity(),
                         bits_to_float(0x7f800001u),  // signaling NaNs and quiet ones
                         bits_to_float(0x7fbfffffu),
                         bits_to_float(0x7fc00001u),
                         bits_to_float(0x7fffffffu),
                         bits_to_float(0x3f808000u),  // bf16 ties
                         bits_to_float(0x3f818000u)};
  for (float x : edges) {
    v.push_back(x);
    v.push_back(-x);
  }
  return v;
}

// Describes the first input whose two results differ, or returns "" if none does.
template <typename Input, typename Got, typename Expected>
std::string first_mismatch(const std::vector<Input>& inputs, Got&& got, Expected&& expected) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (got(i) != expected(inputs[i])) {
      std::ostringstream message;
      message << "input " << i << ": got " << got(i) << ", expected " << expected(inputs[i]);
      return message.str();
    }
  }
  return "";
}

}  // namespace

TEST_CASE("AVX2+F16C conversions give the software conversions' bits") {
  if (!cpu_has_avx2_f16c()) {
    WARN("this CPU has no AVX2+F16C: the hardware conversions are not tested here");
    return;
  }
  // Widening: every fp16 and bf16 bit pattern, through a multiply by one (exact).
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    all[bits] = static_cast<std::uint16_t>(bits);
  }
  std::vector<float> wide(all.size());
  const auto wide_bits = [&](std::size_t i) { return float_to_bits(wide[i]); };
  REQUIRE(avx2::scale(all.data(), DType::kFloat16, wide.data(), DType::kFloat32, 65536, 1.0f));
  REQUIRE(first_mismatch(all, wide_bits,
                         [](std::uint16_t h) { return float_to_bits(fp16_to_float(h)); }) == "");
  REQUIRE(avx2::scale(all.data(), DType::kBFloat16, wide.data(), DType::kFloat32, 65536, 1.0f));
  REQUIRE(first_mismatch(all, wide_bits, [](std::uint16_t h) {
            // A multiply by one sets a signaling NaN's quiet bit, and changes nothing else.
            const float f = bf16_to_float(h);
            return float_to_bits(f) | (std::isnan(f) ? 0x00400000u : 0u);
          }) == "");
  // Narrowing: the rounding cases above, to fp16 and bf16.
  const std::vector<float> inputs = narrowing_inputs();
  const auto n = static_cast<std::int64_t>(inputs.size());
  std::vector<std::uint16_t> narrow(inputs.size());
  const auto narrow_bits = [&](std::size_t i) { return narrow[i]; };
  avx2::scale(inputs.data(), DType::kFloat32, narrow.data(), DType::kFloat16, n, 1.0f);
  REQUIRE(first_mismatch(inputs, narrow_bits, [](float f) { return float_to_fp16(f); }) == "");
  avx2::scale(inputs.data(), DType::kFloat32, narrow.data(), DType::kBFloat16, n, 1.0f);
  REQUIRE(first_mismatch(inputs, narrow_bits, [](float f) { return float_to_bf16(f); }) == "");
}
#endif
