// The CPU LAMB span kernels against the shared element math (lamb_math.h) run one element at a
// time: the 8-lane loops, the scalar tails, the F16C and software conversions must all give
// the same bits as the scalar float code, for fp32, fp16 and bf16 params, with and without
// masters and grad write-back; and the bf16 "split" mode against fp32 masters, bit for bit.
// The float64 comparison is in tests/python/test_lamb.py.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "span_test_values.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

namespace {

template <typename Param>
void check_against_scalar_math(std::size_t n, bool with_master, bool write_grad) {
  const LambConfig config{0.9, 0.999, 1e-6, 0.01, 1.0, true, true, true, false};
  const float grad_scale = 512.0f;
  const LambStep step = make_lamb_constants(config, 4.0f, 1e-2f, grad_scale, 3000.0f);
  REQUIRE(step.clipped);

  const std::vector<Param> param0 = stored<Param>(random_floats(n, 1));
  const std::vector<Param> grad0 = stored<Param>(random_floats(n, 2, 100.0f));
  std::vector<float> master(n);
  for (std::size_t i = 0; i < n; ++i) master[i] = Element<Param>::load(param0[i]);
  const std::vector<float> m0 = random_floats(n, 3, 0.1f);
  std::vector<float> v0 = random_floats(n, 4, 0.1f);
  for (auto& x : v0) x = x * x;

  // The kernels.
  std::vector<Param> param(param0), grad(grad0);
  std::vector<float> m(m0), v(v0), masters(master);
  double param_sq = 0.0, update_sq = 0.0;
  lamb_moments_span(param.data(), dtype_of<Param>(), grad.data(), dtype_of<Param>(), write_grad,
                    m.data(), v.data(), with_master ? masters.data() : nullptr,
                    static_cast<std::int64_t>(n), step, &param_sq, &update_sq);
  const float ratio = lamb_ratio(static_cast<float>(std::sqrt(param_sq)),
                                 static_cast<float>(std::sqrt(update_sq)), step);
  lamb_apply_span(param.data(), dtype_of<Param>(), m.data(), v.data(),
                  with_master ? masters.data() : nullptr, static_cast<std::int64_t>(n), step,
                  ratio);

  // The same math one float at a time.
  double want_param_sq = 0.0, want_update_sq = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = unscale_grad(Element<Param>::load(grad0[i]), grad_scale);
    float mi = m0[i], vi = v0[i];
    const float p = master[i];
    const float u = lamb_moments(g, p, mi, vi, step);
    REQUIRE(same_bits(m[i], mi));
    REQUIRE(same_bits(v[i], vi));
    const Param want_grad = write_grad ? Element<Param>::store(g) : grad0[i];
    REQUIRE(same_bits(grad[i], want_grad));
    want_param_sq += double(p) * p;
    want_update_sq += double(u) * u;
  }
  // The kernels add the squares in fp32 lanes folded into double: close to float64, not equal.
  CHECK(param_sq == Approx(want_param_sq).epsilon(1e-6));
  CHECK(update_sq == Approx(want_update_sq).epsilon(1e-6));
  for (std::size_t i = 0; i < n; ++i) {
    float p = master[i];
    lamb_apply(p, m[i], v[i], ratio, step);
    if (with_master) REQUIRE(same_bits(masters[i], p));
    const Param want = Element<Param>::store(p);
    REQUIRE(same_bits(param[i], want));
  }
}

}  // namespace

TEST_CASE("LAMB spans give the scalar element math's bits, lanes and tails alike") {
  for (std::size_t n :
       {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{133}, std::size_t{1000}}) {
    for (bool write_grad : {false, true}) {
      check_against_scalar_math<float>(n, false, write_grad);
      check_against_scalar_math<Fp16Bits>(n, true, write_grad);
      check_against_scalar_math<Fp16Bits>(n, false, write_grad);
      check_against_scalar_math<Bf16Bits>(n, true, write_grad);
      check_against_scalar_math<Bf16Bits>(n, false, write_grad);
    }
  }
}

TEST_CASE("LAMB constants: clip, trust and bias corrections as apex forms them") {
  LambConfig config{0.9, 0.999, 1e-6, 0.0, 1.0, true, true, true, false};
  // Norm 8 at scale 4 is 2 unscaled: clipped by 2.
  LambStep s = make_lamb_constants(config, 0.0f, 0.1f, 4.0f, 8.0f);
  CHECK(s.clip_divisor == 2.0f);
  CHECK_FALSE(s.trust);  // no weight decay, no nvlamb
  CHECK(lamb_ratio(3.0f, 1.0f, s) == 0.1f);
  // Below the limit, or clipping off: no clip.
  CHECK(make_lamb_constants(config, 0.0f, 0.1f, 4.0f, 3.0f).clip_divisor == 1.0f);
  config.max_grad_norm = 0.0;
  CHECK(make_lamb_constants(config, 0.0f, 0.1f, 1.0f, 1e9f).clip_divisor == 1.0f);
  // use_nvlamb applies the trust ratio without weight decay; zero norms fall back to lr.
  config.use_nvlamb = true;
  s = make_lamb_constants(config, 2.0f, 0.1f, 1.0f, 0.0f);
  CHECK(lamb_ratio(3.0f, 1.5f, s) == 0.1f * (3.0f / 1.5f));
  CHECK(lamb_ratio(0.0f, 1.5f, s) == 0.1f);
  CHECK(lamb_ratio(3.0f, 0.0f, s) == 0.1f);
  // t = 3: 1 - beta^3 from the float betas, in double, rounded once.
  CHECK(s.bias_correction1 == static_cast<float>(1.0 - std::pow(double(0.9f), 3.0)));
  CHECK(s.bias_correction2 == static_cast<float>(1.0 - std::pow(double(0.999f), 3.0)));
  config.grad_averaging = false;
  config.bias_correction = false;
  s = make_lamb_constants(config, 2.0f, 0.1f, 1.0f, 0.0f);
  CHECK(s.beta3 == 1.0f);
  CHECK(s.bias_correction1 == 1.0f);
}

TEST_CASE("LAMB spans of a split bf16 param are the fp32-master spans bit for bit") {
  // Both passes read the master that the param and its low half make up, and the sums of
  // squares are added in the same order (lanes, then the tail): same moments, same trust ratio,
  // same master, for lengths with and without a tail.
  const LambConfig config{0.9, 0.999, 1e-6, 0.01, 1.0, true, true, true, false};
  for (std::int64_t n : {std::int64_t{7}, std::int64_t{133}, std::int64_t{1000}}) {
    const std::vector<Bf16Bits> grad = stored<Bf16Bits>(random_floats(n, 2, 100.0f));
    std::vector<float> master = random_floats(n, 1), m1(n, 0.0f), v1(n, 0.0f), m2(m1), v2(v1);
    std::vector<Bf16Bits> param1 = stored<Bf16Bits>(master);
    std::vector<std::uint16_t> param2(n), low(n);
    for (std::int64_t i = 0; i < n; ++i) {
      Bf16Param<MasterMode::kSplit>::store(master[i], param2[i], low[i], 0u);
    }
    const Bf16Span split{MasterMode::kSplit, low.data(), {0u, 0u}, 0};
    for (int t = 0; t < 4; ++t) {
      const LambStep step =
          make_lamb_constants(config, static_cast<float>(t), 1e-2f, 1.0f, 3000.0f);
      double sq1[2] = {0.0, 0.0}, sq2[2] = {0.0, 0.0};
      lamb_moments_span(param1.data(), DType::kBFloat16, const_cast<Bf16Bits*>(grad.data()),
                        DType::kBFloat16, false, m1.data(), v1.data(), master.data(), n, step,
                        &sq1[0], &sq1[1]);
      lamb_moments_bf16_span(param2.data(), split, const_cast<Bf16Bits*>(grad.data()),
                             DType::kBFloat16, false, m2.data(), v2.data(), n, step, &sq2[0],
                             &sq2[1]);
      REQUIRE(same_bits(sq1[0], sq2[0]));
      REQUIRE(same_bits(sq1[1], sq2[1]));
      const float ratio = lamb_ratio(static_cast<float>(std::sqrt(sq1[0])),
                                     static_cast<float>(std::sqrt(sq1[1])), step);
      lamb_apply_span(param1.data(), DType::kBFloat16, m1.data(), v1.data(), master.data(), n, step,
                      ratio);
      lamb_apply_bf16_span(param2.data(), split, m2.data(), v2.data(), n, step, ratio);
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const float joined = Bf16Param<MasterMode::kSplit>::load(param2[i], low[i]);
      REQUIRE(same_bits(joined, master[i]));
      REQUIRE(same_bits(m1[i], m2[i]));
      REQUIRE(same_bits(v1[i], v2[i]));
    }
  }
}
