// The CPU NovoGrad first pass (novograd_norm_span) and the per-tensor arithmetic between the
// two passes, which the CPU and CUDA kernels share (novograd_math.h). The L2 reduction, the
// per-step constants, the norm blend and the denominator are held against float64; the max
// reduction must be the float reference's bits; an inf or NaN grad must reach both reductions.
// (These run the variant the public span picks; test_novograd_variants.cpp holds the F16C and
// the software-converting lanes to the same bits.)
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "span_test_values.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

namespace {

// Around the 8-lane vectors (tails of 1 to 7 elements) and the 128-element fold of the fp32
// squares into double: spans shorter than, as long as and longer than one fold.
const std::int64_t kNormSizes[] = {1, 7, 8, 37, 127, 128, 129, 1000, 1003};

template <typename Grad>
double reference_sum_of_squares(const std::vector<Grad>& grad, float grad_scale) {
  double sum = 0.0;
  for (const Grad& x : grad) {
    const double g = static_cast<double>(Element<Grad>::load(x)) / grad_scale;
    sum += g * g;
  }
  return sum;
}

// The max norm is exact arithmetic on the unscaled floats: the kernel must give these bits.
template <typename Grad>
float reference_max_abs(const std::vector<Grad>& grad, float grad_scale) {
  float running = 0.0f;
  for (const Grad& x : grad) {
    running = std::max(running, std::fabs(Element<Grad>::load(x) / grad_scale));
  }
  return running;
}

template <typename Grad>
void check_norms(std::int64_t n, float grad_scale) {
  INFO(name_of<Grad>() << " grads, n " << n << ", grad_scale " << grad_scale);
  const std::vector<Grad> grad0 = stored<Grad>(random_floats(n, 11, 100.0f));
  std::vector<Grad> grad(grad0);
  const double l2 = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, grad_scale, false);
  // The squares add in fp32 lanes, folded into double every 128 elements: close, not equal.
  CHECK(l2 == Approx(reference_sum_of_squares(grad0, grad_scale)).epsilon(kRelative));
  const double max = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, grad_scale, true);
  CHECK(max == static_cast<double>(reference_max_abs(grad0, grad_scale)));
  CHECK(same_bytes(grad, grad0));  // the first pass only reads the grads
}

// One inf or NaN grad, at the first, a middle or the last element (in the lanes or in the
// tail), must reach both reductions: a NaN the max norm too, which a plain fmax would drop.
template <typename Grad>
void check_nonfinite_norms(std::int64_t n) {
  for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
    for (float bad : {kNan, kInf, -kInf}) {
      INFO(name_of<Grad>() << " grads, n " << n << ", " << bad << " at " << where);
      std::vector<float> values = random_floats(n, 12, 100.0f);
      values[static_cast<std::size_t>(where)] = bad;
      const std::vector<Grad> grad = stored<Grad>(values);
      const double l2 = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, kGradScale, false);
      const double max = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, kGradScale, true);
      if (std::isnan(bad)) {
        CHECK(std::isnan(max));
        CHECK(std::isnan(l2));
      } else {
        CHECK(l2 == std::numeric_limits<double>::infinity());
        CHECK(max == std::numeric_limits<double>::infinity());
      }
    }
  }
}

}  // namespace

TEST_CASE("NovoGrad L2 norm span: the unscaled sum of squares, lanes, folds and tails",
          "[novograd]") {
  for (std::int64_t n : kNormSizes) {
    for (float grad_scale : {1.0f, kGradScale}) {
      check_norms<float>(n, grad_scale);
      check_norms<Fp16Bits>(n, grad_scale);
      check_norms<Bf16Bits>(n, grad_scale);
    }
  }
}

TEST_CASE("NovoGrad norm span: an inf or NaN grad anywhere reaches the reductions", "[novograd]") {
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{8}, std::int64_t{37}, std::int64_t{129},
                         std::int64_t{1003}}) {
    check_nonfinite_norms<float>(n);
    check_nonfinite_norms<Fp16Bits>(n);
    check_nonfinite_norms<Bf16Bits>(n);
  }
}

TEST_CASE("NovoGrad constants: bias corrections, beta3 and the seed as apex forms them",
          "[novograd]") {
  NovoGradConfig config{0.95, 0.98, 1e-8, 0.001, true, true, false, false, false};
  // apex hands the kernel float betas and forms the corrections from them in double.
  const double beta1 = 0.95f, beta2 = 0.98f;

  // Step 5 (4 taken).
  NovoGradStep s = make_novograd_constants(config, 4.0f, 0.01f, kGradScale);
  CHECK(s.bias_correction1 == static_cast<float>(1.0 - std::pow(beta1, 5.0)));
  CHECK(s.bias_correction2 == static_cast<float>(std::sqrt(1.0 - std::pow(beta2, 5.0))));
  // The double betas would give other bits here: the float ones must be the ones used.
  CHECK(s.bias_correction1 != static_cast<float>(1.0 - std::pow(0.95, 5.0)));
  CHECK(s.bias_correction2 != static_cast<float>(std::sqrt(1.0 - std::pow(0.98, 5.0))));
  CHECK(s.beta1 == 0.95f);
  CHECK(s.beta2 == 0.98f);
  CHECK(s.beta3 == 1.0f - 0.95f);  // grad_averaging
  CHECK(s.one_minus_beta2 == 1.0f - 0.98f);
  CHECK(s.eps == 1e-8f);
  CHECK(s.decay == 0.001f);
  CHECK(s.decayed);
  CHECK(s.lr == 0.01f);
  CHECK(s.grad_scale == kGradScale);
  CHECK(s.steps_taken == 4.0f);
  CHECK_FALSE(s.seed);  // past the first step the running norm blends
  CHECK_FALSE(s.reg_inside_moment);
  CHECK_FALSE(s.max_norm);

  // The first step (t = 1) seeds the running norm with its own.
  s = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(s.seed);
  CHECK(s.bias_correction1 == static_cast<float>(1.0 - beta1));
  CHECK(s.bias_correction2 == static_cast<float>(std::sqrt(1.0 - beta2)));
  CHECK(s.grad_scale == 1.0f);

  // init_zero: the running norm starts at 0, never seeded.
  config.init_zero = true;
  CHECK_FALSE(make_novograd_constants(config, 0.0f, 0.01f, 1.0f).seed);
  CHECK_FALSE(make_novograd_constants(config, 3.0f, 0.01f, 1.0f).seed);

  // Without grad_averaging the grad enters the moment whole; the flags pass through.
  config.grad_averaging = false;
  config.reg_inside_moment = true;
  config.max_norm = true;
  config.weight_decay = 0.0;
  s = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  CHECK(s.beta3 == 1.0f);
  CHECK(s.reg_inside_moment);
  CHECK(s.max_norm);
  CHECK(s.decay == 0.0f);
  CHECK_FALSE(s.decayed);

  // Without bias correction both corrections are 1, at any step.
  config.bias_correction = false;
  for (float steps_taken : {0.0f, 4.0f, 1000.0f}) {
    s = make_novograd_constants(config, steps_taken, 0.01f, 1.0f);
    CHECK(s.bias_correction1 == 1.0f);
    CHECK(s.bias_correction2 == 1.0f);
  }
}

TEST_CASE("NovoGrad norm blend and denominator against float64", "[novograd]") {
  NovoGradConfig config{0.95, 0.98, 1e-8, 0.0, true, true, false, false, false};
  const double beta2 = 0.98f;
  // (old running norm, this step's sum of squares or max |g|)
  const std::pair<float, double> cases[] = {
      {2.5f, 9.0}, {1e-3f, 4e-6}, {300.0f, 1e5}, {0.0f, 16.0}, {7.0f, 0.0}};

  // L2: the running norm is a norm, so its square blends with the sum of squares.
  const NovoGradStep l2 = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  for (const auto& [avg, reduction] : cases) {
    INFO("L2: avg " << avg << ", sum of squares " << reduction);
    const double want = std::sqrt(beta2 * avg * avg + (1.0 - beta2) * reduction);
    const float blended = novograd_blend(avg, reduction, l2);
    CHECK(blended == Approx(want).epsilon(kRelative));
    const double bc2 = std::sqrt(1.0 - std::pow(double(0.98f), 5.0));
    CHECK(novograd_denominator(blended, l2) == Approx(blended / bc2 + double(1e-8f)).epsilon(1e-6));
  }

  // Max: the running norm and the max |g| blend linearly.
  config.max_norm = true;
  const NovoGradStep max = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  for (const auto& [avg, reduction] : cases) {
    INFO("max: avg " << avg << ", max |g| " << reduction);
    CHECK(novograd_blend(avg, reduction, max) ==
          Approx(beta2 * avg + (1.0 - beta2) * reduction).epsilon(kRelative));
  }

  // The first step seeds the running norm with the step's own, whatever the old value: the
  // blend leaves it there (up to rounding).
  config.max_norm = false;
  const NovoGradStep l2_seed = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  config.max_norm = true;
  const NovoGradStep max_seed = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  REQUIRE(l2_seed.seed);
  REQUIRE(max_seed.seed);
  for (const auto& [avg, reduction] : cases) {
    INFO("seed: avg " << avg << ", reduction " << reduction);
    CHECK(novograd_blend(avg, reduction, l2_seed) == Approx(std::sqrt(reduction)).epsilon(1e-6));
    CHECK(novograd_blend(avg, reduction, max_seed) == Approx(reduction).epsilon(1e-6));
  }

  // init_zero: the first step blends into the 0 it is given.
  config.init_zero = true;
  config.max_norm = false;
  const NovoGradStep l2_zero = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(novograd_blend(0.0f, 16.0, l2_zero) == Approx(std::sqrt((1.0 - beta2) * 16.0)));
  config.max_norm = true;
  const NovoGradStep max_zero = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(novograd_blend(0.0f, 4.0, max_zero) == Approx((1.0 - beta2) * 4.0));

  // Without bias correction the denominator is the norm plus eps.
  config.bias_correction = false;
  const NovoGradStep plain = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  CHECK(novograd_denominator(2.0f, plain) == 2.0f + 1e-8f);

  // A non-finite reduction (a NaN or inf grad) carries into the norm, hence the denominator.
  for (const NovoGradStep& s : {l2, max}) {
    CHECK(std::isnan(novograd_blend(2.5f, std::nan(""), s)));
    CHECK(novograd_blend(2.5f, std::numeric_limits<double>::infinity(), s) == kInf);
  }
}
