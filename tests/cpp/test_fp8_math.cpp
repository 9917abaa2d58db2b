// The FP8 cast and the delayed-scaling rule of fp8_math.h against references built from
// the formats' definitions (decode every code, round to the nearest by search).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/fp8_kernels.h"
#include "fp8_math.h"

using ampfuse::kernels::Fp8Format;
using ampfuse::kernels::Fp8ScaleState;

namespace {

// The value of an fp8 code from the format's definition (nan for nan codes).
double decode(std::uint8_t code, Fp8Format format) {
  const int mantissa_bits = format == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = format == Fp8Format::kE4M3 ? 7 : 15;
  const int exponent = (code & 0x7f) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (format == Fp8Format::kE4M3 && (code & 0x7f) == 0x7f) return std::nan("");
  if (format == Fp8Format::kE5M2 && exponent == 31) {
    return mantissa == 0 ? sign * INFINITY : std::nan("");
  }
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits);
}

std::uint8_t encode(float v, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? ampfuse::kernels::encode_fp8<Fp8Format::kE4M3>(v)
                                    : ampfuse::kernels::encode_fp8<Fp8Format::kE5M2>(v);
}

// Non-negative finite codes in increasing value.
std::vector<std::uint8_t> finite_codes(Fp8Format format) {
  std::vector<std::uint8_t> codes;
  for (int c = 0; c < 0x80; ++c) {
    const double v = decode(static_cast<std::uint8_t>(c), format);
    if (std::isfinite(v)) codes.push_back(static_cast<std::uint8_t>(c));
  }
  return codes;
}

}  // namespace

TEST_CASE("every finite fp8 value encodes to its own code, either sign") {
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (std::uint8_t c : finite_codes(format)) {
      const auto v = static_cast<float>(decode(c, format));
      CHECK(encode(v, format) == c);
      if (c != 0) CHECK(encode(-v, format) == (c | 0x80));
    }
  }
}

TEST_CASE("values between two codes round to the nearer, ties to the even code") {
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const std::vector<std::uint8_t> codes = finite_codes(format);
    for (std::size_t i = 0; i + 1 < codes.size(); ++i) {
      const double lo = decode(codes[i], format);
      const double hi = decode(codes[i + 1], format);
      const auto mid = static_cast<float>((lo + hi) / 2);  // exact in fp32
      const std::uint8_t even = (codes[i] & 1) == 0 ? codes[i] : codes[i + 1];
      CHECK(encode(mid, format) == even);
      CHECK(encode(std::nextafter(mid, 0.0f), format) == codes[i]);
      CHECK(encode(std::nextafter(mid, INFINITY), format) == codes[i + 1]);
    }
  }
}

TEST_CASE("the scaled cast saturates inf and large values and keeps nan") {
  using ampfuse::kernels::scale_to_fp8;
  CHECK(scale_to_fp8<Fp8Format::kE4M3>(INFINITY, 1.0f) == 0x7e);  // 448
  CHECK(scale_to_fp8<Fp8Format::kE4M3>(-1e30f, 1.0f) == 0xfe);    // -448
  CHECK(scale_to_fp8<Fp8Format::kE4M3>(1.0f, INFINITY) == 0x7e);
  CHECK(scale_to_fp8<Fp8Format::kE5M2>(INFINITY, 1.0f) == 0x7b);  // 57344
  CHECK(scale_to_fp8<Fp8Format::kE5M2>(-60000.0f, 1.0f) == 0xfb);
  CHECK((scale_to_fp8<Fp8Format::kE4M3>(std::nanf(""), 2.0f) & 0x7f) == 0x7f);
  CHECK((scale_to_fp8<Fp8Format::kE5M2>(std::nanf(""), 2.0f) & 0x7f) == 0x7f);
  CHECK(scale_to_fp8<Fp8Format::kE4M3>(3.0f, 0.5f) == encode(1.5f, Fp8Format::kE4M3));
}

float amax_of_span(const std::vector<float>& x, std::vector<std::uint8_t>& out) {
  out.resize(x.size());
  const std::uint32_t bits = ampfuse::kernels::cpu::fp8_cast_amax_span(
      x.data(), ampfuse::kernels::DType::kFloat32, out.data(), static_cast<std::int64_t>(x.size()),
      100.0f, Fp8Format::kE4M3);
  float amax;
  std::memcpy(&amax, &bits, sizeof(amax));
  return amax;
}

TEST_CASE("the CPU span returns the amax of the unscaled input, nan above inf") {
  std::vector<std::uint8_t> out;
  CHECK(amax_of_span({0.5f, -3.0f, 2.0f, 0.0f}, out) == 3.0f);
  CHECK(out[1] == 0xf9);  // -300 rounds to -288 (e4m3 steps by 32 there)
  CHECK(out[2] == 0x74);  // 200 is halfway between 192 and 208: to 192, the even code
  CHECK(std::isinf(amax_of_span({1.0f, -INFINITY, 2.0f}, out)));
  CHECK(out[1] == 0xfe);
  CHECK(std::isnan(amax_of_span({std::nanf(""), INFINITY, 2.0f}, out)));
  CHECK(std::isnan(amax_of_span({1.0f, INFINITY, -std::nanf("")}, out)));
  CHECK(amax_of_span({}, out) == 0.0f);
}

namespace {

struct OneState {
  float amax;
  std::vector<float> history;
  float scale = 1.0f;
  float scale_inv = 1.0f;
  Fp8ScaleState view(float fp8_max = 448.0f) {
    return {&amax,  history.data(), static_cast<std::int64_t>(history.size()),
            &scale, &scale_inv,     fp8_max};
  }
};

}  // namespace

TEST_CASE("the delayed-scaling rule rolls the history and follows fp8_max / amax / 2^margin") {
  OneState s{2.0f, {5.0f, 1.0f, 0.0f}};
  ampfuse::kernels::update_fp8_scale(s.view(), 2.0f, /*use_max=*/true, /*skip=*/false);
  CHECK(s.history == std::vector<float>{2.0f, 5.0f, 1.0f});
  CHECK(s.amax == 0.0f);
  CHECK(s.scale == (448.0f / 5.0f) / 2.0f);
  CHECK(s.scale_inv == 1.0f / s.scale);
  s.amax = 3.0f;
  ampfuse::kernels::update_fp8_scale(s.view(), 1.0f, /*use_max=*/false, /*skip=*/false);
  CHECK(s.history == std::vector<float>{3.0f, 2.0f, 5.0f});
  CHECK(s.scale == 448.0f / 3.0f);
}

TEST_CASE("a zero or non-finite amax keeps the scale; a skipped step keeps everything") {
  for (float bad : {0.0f, INFINITY, std::nanf("")}) {
    OneState s{bad, {0.0f, 0.0f}, 4.0f, 0.25f};
    ampfuse::kernels::update_fp8_scale(s.view(), 1.0f, false, false);
    CHECK(s.scale == 4.0f);
    CHECK(s.scale_inv == 0.25f);
    CHECK(s.amax == 0.0f);
  }
  OneState s{7.0f, {1.0f, 2.0f}, 4.0f, 0.25f};
  ampfuse::kernels::update_fp8_scale(s.view(), 1.0f, true, /*skip=*/true);
  CHECK(s.history == std::vector<float>{1.0f, 2.0f});
  CHECK(s.scale == 4.0f);
  CHECK(s.amax == 0.0f);
}

TEST_CASE("a tiny amax whose scale would overflow keeps the old scale") {
  OneState s{1e-45f, {0.0f}, 8.0f, 0.125f};
  ampfuse::kernels::update_fp8_scale(s.view(57344.0f), 1.0f, true, false);
  CHECK(s.scale == 8.0f);
}
