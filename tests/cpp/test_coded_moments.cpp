// The CPU span loops of coded_moments.h against state_codes.h's block functions, which define
// the codes: every code decodes to decode_block's bits, and spans of whole and short blocks,
// zeros, infs and several nans with different payloads code to encode_block's codes and scales.
// Each check runs the dispatching functions and every implementation the processor has
// (portable::, avx2_fma::, avx512::), the vector ones also at the edges of their vector path.
// Their division-free quotients are checked in test_exact_quotient.cpp.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/coded_moments.h"
#include "cpu/lanes_avx512.h"
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

using DecodeSpan = void (*)(const std::uint8_t*, const float*, std::int64_t, std::int64_t,
                            StateCode, bool, float*);
using EncodeSpan = void (*)(const float*, std::int64_t, std::int64_t, StateCode, bool,
                            std::uint8_t*, float*);

struct Implementation {
  const char* name;
  DecodeSpan decode;
  EncodeSpan encode;
};

// The implementations this processor can run.
std::vector<Implementation> implementations() {
  std::vector<Implementation> all = {
      {"dispatch", k::cpu::decode_moment_span, k::cpu::encode_moment_span},
      {"portable", k::cpu::portable::decode_moment_span, k::cpu::portable::encode_moment_span}};
#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
  if (k::cpu::avx2_fma::supported()) {
    all.push_back(
        {"avx2_fma", k::cpu::avx2_fma::decode_moment_span, k::cpu::avx2_fma::encode_moment_span});
  }
  if (k::cpu::cpu_has_avx512()) {
    all.push_back(
        {"avx512", k::cpu::avx512::decode_moment_span, k::cpu::avx512::encode_moment_span});
  }
#endif
  return all;
}

template <StateCode kCode, bool kSecond>
void check_decode(const Implementation& impl) {
  // Every code under several scales, as one span of 256-element blocks.
  // (The last block is short, so its tail runs the scalar loop.)
  const float scales[] = {1.0f,  0.0f,     3.0e-5f,  7.5f,
                          -2.0f, 1.0e-40f, INFINITY, nan_with_payload(2)};
  constexpr int kBlocks = 8;
  std::vector<std::uint8_t> codes(256 * kBlocks - 3);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(i);
  std::vector<float> out(codes.size()), expected(codes.size());
  impl.decode(codes.data(), scales, 0, static_cast<std::int64_t>(codes.size()), kCode, kSecond,
              out.data());
  for (int b = 0; b < kBlocks; ++b) {
    const int size = std::min<int>(256, static_cast<int>(codes.size()) - 256 * b);
    k::decode_block<kCode, kSecond>(codes.data() + 256 * b, size, scales[b],
                                    expected.data() + 256 * b);
  }
  INFO(impl.name);
  for (std::size_t i = 0; i < out.size(); ++i) {
    INFO("element " << i);
    REQUIRE(bits(out[i]) == bits(expected[i]));
  }
}

template <StateCode kCode, bool kSecond>
void check_encode(const Implementation& impl, const std::vector<float>& moment) {
  const auto n = static_cast<std::int64_t>(moment.size());
  const std::int64_t blocks = (n + 255) / 256;
  std::vector<std::uint8_t> codes(moment.size()), expected_codes(moment.size());
  std::vector<float> scales(blocks), expected_scales(blocks);
  impl.encode(moment.data(), 0, n, kCode, kSecond, codes.data(), scales.data());
  for (std::int64_t b = 0; b < blocks; ++b) {
    const int size = static_cast<int>(std::min<std::int64_t>(256, n - 256 * b));
    k::encode_block<kCode, kSecond>(moment.data() + 256 * b, size, expected_codes.data() + 256 * b,
                                    &expected_scales[b]);
  }
  INFO(impl.name);
  for (std::int64_t b = 0; b < blocks; ++b) {
    INFO("block " << b);
    REQUIRE(bits(scales[b]) == bits(expected_scales[b]));
  }
  for (std::int64_t i = 0; i < n; ++i) {
    INFO("element " << i << " value " << moment[i]);
    REQUIRE(static_cast<int>(codes[i]) == static_cast<int>(expected_codes[i]));
  }
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
  for (const Implementation& impl : implementations()) check_encode<kCode, kSecond>(impl, moment);
}

// Blocks at the edges of avx2_fma's vector path: absmax just above and below its smallest
// divisor (2^-70), subnormal and huge absmaxes, blocks of tiny values under a large absmax
// (quotients that underflow), -0s, exact ties of every format, and random values across 80
// binades.
template <StateCode kCode, bool kSecond>
void check_encode_edges() {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-60, 20);
  std::vector<float> moment;
  auto block = [&](float absmax, auto&& value) {
    for (int i = 0; i < 256; ++i) moment.push_back(i == 0 ? absmax : value(i));
  };
  for (const float absmax : {0x1p-70f, 0x1.fffffep-71f, 0x1p-69f, 0x1p-100f, 1.0e-40f, 0x1p-126f,
                             1.0f, 0x1.fffffep127f, 3.0e30f, 1.0e-20f}) {
    block(absmax, [&](int) { return unit(gen) * absmax; });
    block(absmax, [&](int i) { return (i % 2 ? -1.0f : 1.0f) * std::ldexp(unit(gen), -i / 4); });
  }
  block(3.0e30f, [&](int i) { return i % 3 ? -1.0e-30f : 1.0e-40f; });  // underflowing quotients
  block(1.0f, [&](int i) { return i % 2 ? -0.0f : 0.0f; });
  // Ties: k/254 (int8's halfway points), (2k+1)/2^19 (e4m4 steps) and e4m3 midpoints / 448.
  block(1.0f, [&](int i) { return static_cast<float>(i - 128) / 254.0f; });
  block(1.0f, [&](int i) { return static_cast<float>(2 * i + 1) * 0x1p-19f; });
  block(1.0f, [&](int i) {
    return std::ldexp(1.0f + static_cast<float>(2 * (i % 8) + 1) / 16.0f, i / 8 - 16) / 448.0f;
  });
  for (int b = 0; b < 40; ++b) {
    const float scale = std::ldexp(1.0f, binade(gen));
    block(scale * 1.5f, [&](int) { return unit(gen) * std::ldexp(scale, -(gen() % 24)); });
  }
  if (kSecond) {
    for (float& x : moment) x = x * x;  // the second moment is coded through its square root
  }
  for (const Implementation& impl : implementations()) check_encode<kCode, kSecond>(impl, moment);
}

}  // namespace

TEST_CASE("coded moments: every code decodes to decode_block's bits") {
  for (const Implementation& impl : implementations()) {
    check_decode<StateCode::kInt8, false>(impl);
    check_decode<StateCode::kInt8, true>(impl);
    check_decode<StateCode::kFp8, false>(impl);
    check_decode<StateCode::kFp8, true>(impl);
  }
}

TEST_CASE("coded moments: spans code to encode_block's codes and scales, nans included") {
  check_encode_cases<StateCode::kInt8, false>();
  check_encode_cases<StateCode::kInt8, true>();
  check_encode_cases<StateCode::kFp8, false>();
  check_encode_cases<StateCode::kFp8, true>();
}

TEST_CASE("coded moments: blocks at the edges of the vector path code as encode_block does") {
  check_encode_edges<StateCode::kInt8, false>();
  check_encode_edges<StateCode::kInt8, true>();
  check_encode_edges<StateCode::kFp8, false>();
  check_encode_edges<StateCode::kFp8, true>();
}
