// The CPU span loops of coded_moments.h against state_codes.h's block functions, which define
// the codes: every code decodes to decode_block's bits (through the table), and spans of whole
// and short blocks, zeros, infs and several nans with different payloads code to encode_block's
// codes and scales.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/coded_moments.h"
#include "state_codes.h"

using ampfuse::kernels::StateCode;
namespace k = ampfuse::kernels;

namespace {

std::uint32_t bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float nan_with_payload(std::uint32_t payload) {
  const std::uint32_t b = 0x7fc00000u | payload;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

template <StateCode kCode, bool kSecond>
void check_decode() {
  // Every code under several scales, as one span of 256-element blocks.
  const float scales[] = {1.0f, 0.0f, 3.0e-5f, 7.5f};
  std::vector<std::uint8_t> codes(256 * 4);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(i);
  std::vector<float> out(codes.size()), expected(codes.size());
  k::cpu::decode_moment_span(codes.data(), scales, 0, static_cast<std::int64_t>(codes.size()),
                             kCode, kSecond, out.data());
  for (int b = 0; b < 4; ++b) {
    k::decode_block<kCode, kSecond>(codes.data() + 256 * b, 256, scales[b],
                                    expected.data() + 256 * b);
  }
  for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(bits(out[i]) == bits(expected[i]));
}

template <StateCode kCode, bool kSecond>
void check_encode(std::vector<float> moment) {
  const auto n = static_cast<std::int64_t>(moment.size());
  const std::int64_t blocks = (n + 255) / 256;
  std::vector<std::uint8_t> codes(moment.size()), expected_codes(moment.size());
  std::vector<float> scales(blocks), expected_scales(blocks);
  k::cpu::encode_moment_span(moment.data(), 0, n, kCode, kSecond, codes.data(), scales.data());
  for (std::int64_t b = 0; b < blocks; ++b) {
    const int size = static_cast<int>(std::min<std::int64_t>(256, n - 256 * b));
    k::encode_block<kCode, kSecond>(moment.data() + 256 * b, size,
                                    expected_codes.data() + 256 * b, &expected_scales[b]);
  }
  REQUIRE(codes == expected_codes);
  for (std::int64_t b = 0; b < blocks; ++b) REQUIRE(bits(scales[b]) == bits(expected_scales[b]));
}

template <StateCode kCode, bool kSecond>
void check_encode_cases() {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> moment(256 * 5 + 77);  // whole blocks and a short last one
  for (float& x : moment) x = kSecond ? normal(gen) * normal(gen) : normal(gen);
  for (std::size_t i = 256; i < 512; ++i) moment[i] = 0.0f;  // a block of zeros
  moment[600] = INFINITY;                                    // an inf
  moment[800] = nan_with_payload(5);                         // nans with different payloads:
  moment[900] = nan_with_payload(9);                         // the last one is the scale
  moment[1000] = nan_with_payload(7);
  moment[1100] = -nan_with_payload(1);
  moment[moment.size() - 1] = nan_with_payload(3);  // the last element of the short block
  check_encode<kCode, kSecond>(moment);
}

}  // namespace

TEST_CASE("coded moments: every code decodes to decode_block's bits") {
  check_decode<StateCode::kInt8, false>();
  check_decode<StateCode::kInt8, true>();
  check_decode<StateCode::kFp8, false>();
  check_decode<StateCode::kFp8, true>();
}

TEST_CASE("coded moments: spans code to encode_block's codes and scales, nans included") {
  check_encode_cases<StateCode::kInt8, false>();
  check_encode_cases<StateCode::kInt8, true>();
  check_encode_cases<StateCode::kFp8, false>();
  check_encode_cases<StateCode::kFp8, true>();
}
