// The moment codes of state_codes.h against references built from the codes' definitions:
// decode every code from its closed form, encode by searching for the nearest code (ties to
// the even code), and bound a block's round trip against double arithmetic.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "state_codes.h"

using ampfuse::kernels::StateCode;
namespace k = ampfuse::kernels;

namespace {

double sqrt_code_value(int code) {
  const int e = code >> 4, f = code & 15;
  return e == 0 ? std::ldexp(f, -18) : std::ldexp(16 + f, e - 19);
}

double e4m3_value(int code) {
  const int e = (code & 0x7f) >> 3, f = code & 7;
  const double magnitude = e == 0 ? std::ldexp(f, -9) : std::ldexp(8 + f, e - 10);
  return (code & 0x80) ? -magnitude : magnitude;
}

// The code in [lo, hi] nearest to x under `value`, ties to the even code (value increasing).
template <typename Value>
int nearest_code(double x, int lo, int hi, Value value) {
  int best = lo;
  for (int c = lo + 1; c <= hi; ++c) {
    const double d = std::fabs(value(c) - x), b = std::fabs(value(best) - x);
    if (d < b || (d == b && c % 2 == 0)) best = c;
  }
  return best;
}

std::vector<float> unit_samples() {
  std::vector<float> out;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> octave(-24, -1);
  for (int i = 0; i < 20000; ++i) out.push_back(std::ldexp(mantissa(gen), octave(gen)));
  for (int c = 0; c < 240; ++c) {  // every midpoint between neighbouring codes: the ties
    out.push_back(static_cast<float>((sqrt_code_value(c) + sqrt_code_value(c + 1)) / 2));
  }
  out.push_back(0.0f);
  out.push_back(1.0f);
  return out;
}

}  // namespace

TEST_CASE("state codes: the sqrt code decodes to its closed form and rounds to the nearest") {
  for (int c = 0; c <= 240; ++c) {
    REQUIRE(k::decode_sqrt_u8_unit(static_cast<std::uint8_t>(c)) == sqrt_code_value(c));
    REQUIRE(k::encode_sqrt_u8(k::decode_sqrt_u8_unit(static_cast<std::uint8_t>(c))) == c);
  }
  for (float n : unit_samples()) {
    INFO("n = " << n);
    REQUIRE(k::encode_sqrt_u8(n) == nearest_code(n, 0, 240, sqrt_code_value));
  }
}

TEST_CASE("state codes: e4m3 of x/absmax decodes to the format and rounds to the nearest") {
  for (int c = 0; c <= 0x7e; ++c) {
    REQUIRE(k::decode_e4m3(static_cast<std::uint8_t>(c)) == e4m3_value(c));
    REQUIRE(k::decode_e4m3(static_cast<std::uint8_t>(c | 0x80)) == e4m3_value(c | 0x80));
  }
  for (float n : unit_samples()) {
    INFO("n = " << n);
    const int code = nearest_code(static_cast<double>(n * 448.0f), 0, 0x7e, e4m3_value);
    REQUIRE(k::encode_e4m3_unit(n) == code);
    REQUIRE(k::encode_e4m3_unit(-n) == (n == 0.0f ? 0x80 : code | 0x80));
  }
}

TEST_CASE("state codes: the linear int8 code rounds to nearest, ties to even") {
  for (int c = -127; c <= 127; ++c) {
    const float n = static_cast<float>(c) / 127.0f;
    REQUIRE(k::encode_linear_int8(n) == c);
  }
  REQUIRE(k::encode_linear_int8(2.5f / 127.0f) == 2);
  REQUIRE(k::encode_linear_int8(3.5f / 127.0f) == 4);
}

template <StateCode kCode, bool kSecond>
void check_block_round_trip(double relative, double absolute_of_absmax) {
  std::mt19937 gen(kSecond ? 11 : 12);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> octave(-12, 0);
  for (int n : {1, 100, k::kStateBlock}) {
    std::vector<float> moment(n), back(n);
    for (float& x : moment) {
      x = std::ldexp(normal(gen), octave(gen));
      if (kSecond) x = x * x;
    }
    std::vector<std::uint8_t> codes(n);
    float scale = -1.0f;
    k::encode_block<kCode, kSecond>(moment.data(), n, codes.data(), &scale);
    k::decode_block<kCode, kSecond>(codes.data(), n, scale, back.data());
    double absmax = 0.0;
    for (float x : moment) absmax = std::fmax(absmax, std::fabs(kSecond ? std::sqrt(x) : x));
    REQUIRE(scale == static_cast<float>(absmax));
    for (int i = 0; i < n; ++i) {
      const double ref = kSecond ? std::sqrt(static_cast<double>(moment[i])) : moment[i];
      const double got = kSecond ? std::sqrt(static_cast<double>(back[i])) : back[i];
      const double bound = std::fmax(std::fabs(ref) * relative, absmax * absolute_of_absmax) +
                           std::fabs(ref) * 0x1p-21 + 1e-45;
      INFO("block of " << n << ", element " << i << ": " << ref << " -> " << got);
      REQUIRE(std::fabs(got - ref) <= bound);
    }
  }
}

TEST_CASE("state codes: a block round trip stays within half a code step of double") {
  check_block_round_trip<StateCode::kInt8, false>(0.0, 1.0 / 254.0);
  check_block_round_trip<StateCode::kInt8, true>(0x1p-5, 0x1p-19);
  check_block_round_trip<StateCode::kFp8, false>(0x1p-4, 0x1p-10 / 448.0);
  check_block_round_trip<StateCode::kFp8, true>(0x1p-4, 0x1p-10 / 448.0);
}

TEST_CASE("state codes: a block of zeros codes to zeros with a zero scale") {
  std::vector<float> zeros(k::kStateBlock, 0.0f), back(k::kStateBlock, 1.0f);
  std::vector<std::uint8_t> codes(k::kStateBlock, 0xff);
  float scale = -1.0f;
  k::encode_block<StateCode::kInt8, true>(zeros.data(), k::kStateBlock, codes.data(), &scale);
  k::decode_block<StateCode::kInt8, true>(codes.data(), k::kStateBlock, scale, back.data());
  REQUIRE(scale == 0.0f);
  REQUIRE(back == zeros);
}

TEST_CASE("state codes: a nan moment makes its block's scale nan and its codes 0") {
  for (int where : {0, k::kStateBlock / 2, k::kStateBlock - 1}) {
    std::vector<float> moment(k::kStateBlock, 0.25f), back(k::kStateBlock);
    moment[where] = std::nanf("");
    std::vector<std::uint8_t> codes(k::kStateBlock, 0xff);
    float scale = 0.0f;
    k::encode_block<StateCode::kInt8, false>(moment.data(), k::kStateBlock, codes.data(), &scale);
    k::decode_block<StateCode::kInt8, false>(codes.data(), k::kStateBlock, scale, back.data());
    REQUIRE(std::isnan(scale));
    for (int i = 0; i < k::kStateBlock; ++i) {
      REQUIRE(codes[i] == 0);
      REQUIRE(std::isnan(back[i]));
    }
  }
}
