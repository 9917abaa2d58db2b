// The bf16 master modes (bf16_modes.h) and their CPU span kernels: stochastic rounding's
// probabilities counted exactly, the split and kahan representations, and split against the
// fp32-master kernel bit for bit (Adam and Adagrad).
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "bf16_modes.h"
#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

TEST_CASE("stochastic rounding rounds up for exactly low16 of the 65536 random values") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint32_t bits = rng() & 0x7f7fffffu;  // finite, positive or (below) negative
    const float f = bits_to_float(bits | (trial % 2 ? 0x80000000u : 0u));
    const std::uint16_t down = static_cast<std::uint16_t>(float_to_bits(f) >> 16);
    std::uint32_t up = 0;
    for (std::uint32_t r = 0; r < 65536; ++r) {
      const std::uint16_t rounded = bf16_stochastic(f, r);
      REQUIRE((rounded == down || rounded == down + 1));
      up += rounded != down;
    }
    REQUIRE(up == (float_to_bits(f) & 0xffffu));
  }
  // inf and NaN round to nearest, as c10 does.
  REQUIRE(bf16_stochastic(bits_to_float(0x7f800000u), 0xffffu) == 0x7f80u);
  REQUIRE(bf16_stochastic(bits_to_float(0x7f800001u), 0x1234u) == 0x7fc0u);
}

TEST_CASE("rounding bits depend on every part of the key and on the index") {
  const RoundingKey key = chunk_key(rounding_key(1, 5.0f, 7), 0);
  std::vector<std::uint32_t> bits(65536);
  double sum = 0.0;
  for (std::uint32_t i = 0; i < bits.size(); ++i) {
    bits[i] = rounding_bits(key, i);
    REQUIRE(bits[i] < 65536u);
    sum += bits[i];
  }
  REQUIRE(std::abs(sum / bits.size() / 65535.0 - 0.5) < 0.01);
  for (const RoundingKey other :
       {chunk_key(rounding_key(2, 5.0f, 7), 0), chunk_key(rounding_key(1, 6.0f, 7), 0),
        chunk_key(rounding_key(1, 5.0f, 8), 0),
        chunk_key(rounding_key(1, 5.0f, 7), std::int64_t{1} << 32)}) {
    int same = 0;
    for (std::uint32_t i = 0; i < 1024; ++i) same += rounding_bits(other, i) == bits[i];
    REQUIRE(same < 8);
  }
}

TEST_CASE("split keeps a float's two halves; kahan keeps about 16 bits") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 10000; ++trial) {
    // Finite, with exponents from 2^-100 to 2^99: a compensation can hold the remainder only
    // while it is itself a normal bf16.
    const std::uint32_t exponent = 27u + rng() % 200u;
    const float x = bits_to_float((rng() & 0x807fffffu) | (exponent << 23));
    std::uint16_t param, low;
    Bf16Param<MasterMode::kSplit>::store(x, param, low, 0);
    REQUIRE(float_to_bits(Bf16Param<MasterMode::kSplit>::load(param, low)) == float_to_bits(x));
    // The param is master_weights=True's (to nearest, ties to even) but at a tie above an even
    // half, which rounds away from zero (bf16_modes.h: no 16-bit remainder keeps that tie).
    const std::uint32_t u = float_to_bits(x);
    const bool even_tie = (u & 0xffffu) == 0x8000u && ((u >> 16) & 1u) == 0u;
    REQUIRE(param == (even_tie ? (u >> 16) + 1u : float_to_bf16(x)));
    std::uint16_t compensation;
    Bf16Param<MasterMode::kKahan>::store(x, param, compensation, 0);
    REQUIRE(param == float_to_bf16(x));
    const float back = Bf16Param<MasterMode::kKahan>::load(param, compensation);
    REQUIRE(std::abs(back - x) <= std::abs(x) * 0x1p-15f);
  }
}

TEST_CASE("split holds every fp32 pattern exactly, its param rounded to nearest") {
  // Every high half with the low halves where rounding turns (0, 0x7fff, 0x8000, 0x8001,
  // 0xffff) and a random one: infinities, the masters that round to them, NaNs, zeros and
  // subnormals included.
  std::mt19937 rng(11);
  for (std::uint32_t high = 0; high < 0x10000u; ++high) {
    for (const std::uint32_t low_half : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                                         static_cast<std::uint32_t>(rng() & 0xffffu)}) {
      const std::uint32_t u = (high << 16) | low_half;
      const float x = bits_to_float(u);
      std::uint16_t param, low;
      Bf16Param<MasterMode::kSplit>::store(x, param, low, 0);
      const std::uint32_t back = float_to_bits(Bf16Param<MasterMode::kSplit>::load(param, low));
      const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
      if (nan) {
        REQUIRE(param == 0x7fc0u);
        REQUIRE((back & 0x7fffffffu) > 0x7f800000u);  // still a NaN
        continue;
      }
      REQUIRE(back == u);
      const bool even_tie = low_half == 0x8000u && (high & 1u) == 0u;
      REQUIRE(param == (even_tie ? high + 1u : float_to_bf16(x)));
    }
  }
}

TEST_CASE("split's masters equal the fp32-master kernel's bit for bit") {
  const std::int64_t n = 1000;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> master(n), m1(n, 0.0f), v1(n, 0.0f), m2(n, 0.0f), v2(n, 0.0f);
  std::vector<std::uint16_t> param1(n), param2(n), low(n, 0), grad(n);
  for (std::int64_t i = 0; i < n; ++i) {
    param1[i] = param2[i] = float_to_bf16(dist(rng));
    master[i] = bf16_to_float(param1[i]);
  }
  const AdamConfig config{0.9, 0.999, 1e-8, 0.01, true, true, false, false};
  for (int t = 0; t < 5; ++t) {
    for (auto& g : grad) g = float_to_bf16(dist(rng));
    const AdamStep step = make_step_constants(config, static_cast<float>(t), 1e-3f, 1.0f);
    adam_span(param1.data(), DType::kBFloat16, grad.data(), DType::kBFloat16, false, m1.data(),
              v1.data(), nullptr, master.data(), n, step);
    const Bf16Span split{MasterMode::kSplit, low.data(), {0u, 0u}, 0};
    adam_bf16_span(param2.data(), split, grad.data(), DType::kBFloat16, false, m2.data(), v2.data(),
                   nullptr, n, step);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float joined = Bf16Param<MasterMode::kSplit>::load(param2[i], low[i]);
    REQUIRE(float_to_bits(joined) == float_to_bits(master[i]));
    REQUIRE(m1[i] == m2[i]);
    const std::uint32_t u = float_to_bits(master[i]);
    if ((u & 0xffffu) != 0x8000u) REQUIRE(param2[i] == param1[i]);
  }
}

// Adagrad (adagrad_bf16_span) with L2 decay and an lr decay, so that the update reads the
// param and the step count: split must see the joined master. Stochastic's bits follow the
// element's index, not the span it is stepped in (the op splits params into spans by load).
TEST_CASE("Adagrad's bf16 spans: split equals the fp32-master kernel; spans do not move bits") {
  const std::int64_t n = 1000, half = 403;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> master(n), sum1(n, 0.1f), sum2(n, 0.1f), sum3(n, 0.1f), sum4(n, 0.1f);
  std::vector<std::uint16_t> param1(n), param2(n), low(n, 0), whole(n), parts(n), grad(n);
  for (std::int64_t i = 0; i < n; ++i) {
    param1[i] = param2[i] = whole[i] = parts[i] = float_to_bf16(dist(rng));
    master[i] = bf16_to_float(param1[i]);
  }
  for (const bool decoupled : {false, true}) {
    const AdagradConfig config{0.01, 0.01, 1e-10, decoupled, false};
    for (int t = 0; t < 5; ++t) {
      for (auto& g : grad) g = float_to_bf16(dist(rng));
      const AdagradStep step = make_step_constants(config, static_cast<float>(t), 1e-2f, 1.0f);
      adagrad_span(param1.data(), DType::kBFloat16, grad.data(), DType::kBFloat16, false,
                   sum1.data(), master.data(), n, step);
      const Bf16Span split{MasterMode::kSplit, low.data(), {0u, 0u}, 0};
      adagrad_bf16_span(param2.data(), split, grad.data(), DType::kBFloat16, false, sum2.data(), n,
                        step);
      const RoundingKey key = rounding_key(3, static_cast<float>(t), 5);
      adagrad_bf16_span(whole.data(), {MasterMode::kStochastic, nullptr, key, 0}, grad.data(),
                        DType::kBFloat16, false, sum3.data(), n, step);
      adagrad_bf16_span(parts.data(), {MasterMode::kStochastic, nullptr, key, 0}, grad.data(),
                        DType::kBFloat16, false, sum4.data(), half, step);
      adagrad_bf16_span(parts.data() + half, {MasterMode::kStochastic, nullptr, key, half},
                        grad.data() + half, DType::kBFloat16, false, sum4.data() + half, n - half,
                        step);
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float joined = Bf16Param<MasterMode::kSplit>::load(param2[i], low[i]);
    REQUIRE(float_to_bits(joined) == float_to_bits(master[i]));
    REQUIRE(float_to_bits(sum1[i]) == float_to_bits(sum2[i]));
    REQUIRE(whole[i] == parts[i]);
    REQUIRE(float_to_bits(sum3[i]) == float_to_bits(sum4[i]));
  }
}
