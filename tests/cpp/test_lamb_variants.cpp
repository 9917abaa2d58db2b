// The AVX2+F16C LAMB span kernels against the portable ones (lamb_variants.h), bit for bit: both
// passes, over every (param, grad) dtype pair, with L2 and decoupled weight decay, with and
// without clipping and the trust ratio. On a CPU with F16C the public spans take the F16C lanes
// for fp16/bf16, so this is the one test that runs the software-converting lanes on data of
// those types there.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/lamb_variants.h"
#include "lamb_math.h"
#include "span_test_values.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

// One copy of everything a step touches, and the last step's sums of squares; two of them, one
// per implementation, start equal.
struct State {
  Array param, grad;
  std::vector<float> exp_avg, exp_avg_sq, master;
  double param_sq = 0.0, update_sq = 0.0;

  // Params within fp16's range: without a master an inf param makes the tensor's param norm,
  // hence the trust ratio and every update, inf or NaN. The masters go past it, so that their
  // stores into fp16 params overflow. Grads within it too, as the non-finite cases add their own.
  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false, /*beyond_fp16=*/false)),
        grad(grad_dtype, test_values(n, 2, nonfinite, /*beyond_fp16=*/false)),
        exp_avg(test_values(n, 3, false)),
        exp_avg_sq(squares(test_values(n, 4, false))),
        master(test_values(n, 1, false)) {}

  static std::vector<float> squares(std::vector<float> v) {
    for (float& x : v) x *= x;
    return v;
  }
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.exp_avg, b.exp_avg) &&
         same(a.exp_avg_sq, b.exp_avg_sq) && same(a.master, b.master) &&
         same(a.param_sq, b.param_sq) && same(a.update_sq, b.update_sq);
}

// One LAMB step of one implementation, as the CPU op runs it on a one-span tensor: the moments
// and sums, the trust ratio, the update.
void lamb_step(bool use_avx2, State& s, bool master, bool write_grad, std::int64_t n,
               const LambStep& constants) {
  auto* moments = use_avx2 ? cpu::avx2::lamb_moments : cpu::portable::lamb_moments;
  auto* apply = use_avx2 ? cpu::avx2::lamb_apply : cpu::portable::lamb_apply;
  float* masters = master ? s.master.data() : nullptr;
  s.param_sq = s.update_sq = 0.0;
  moments(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write_grad,
          s.exp_avg.data(), s.exp_avg_sq.data(), masters, n, constants, &s.param_sq,
          &s.update_sq);
  float ratio = lamb_ratio(static_cast<float>(std::sqrt(s.param_sq)),
                           static_cast<float>(std::sqrt(s.update_sq)), constants);
  // The op skips a step whose grads are not finite; run anyway with the plain learning rate, so
  // that the update stays finite where the moments are and the lanes' inf and NaN grads are
  // compared element by element.
  if (!std::isfinite(ratio)) ratio = constants.lr;
  apply(s.param.data(), s.param.dtype, s.exp_avg.data(), s.exp_avg_sq.data(), masters, n,
        constants, ratio);
}

}  // namespace

TEST_CASE("AVX2+F16C LAMB gives the portable kernel's bits, moments, sums and updates") {
  if (!cpu_runs_avx2_kernels()) return;
  for (double max_grad_norm : {0.0, 1.0}) {
    // L2 decay, decoupled decay, the trust ratio without decay (use_nvlamb), and none of them
    // with neither bias correction nor grad averaging. Clipping at 1 clips every step: the grad
    // norm passed is 40 unscaled.
    const LambConfig configs[] = {
        {0.9, 0.999, 1e-6, 0.01, max_grad_norm, false, true, true, false},
        {0.9, 0.999, 1e-6, 0.01, max_grad_norm, true, true, true, false},
        {0.9, 0.999, 1e-6, 0.0, max_grad_norm, true, true, true, true},
        {0.9, 0.999, 1e-6, 0.0, max_grad_norm, true, false, false, false},
    };
    for (const LambConfig& config : configs) {
      INFO("max_grad_norm " << max_grad_norm << " weight_decay " << config.weight_decay
                            << " adam_w_mode " << config.adam_w_mode << " use_nvlamb "
                            << config.use_nvlamb << " bias_correction "
                            << config.bias_correction);
      compare_variants<State>("lamb", [&](bool use_avx2, State& s, bool master, bool write,
                                          std::int64_t n, int t) {
        lamb_step(use_avx2, s, master, write, n,
                  make_lamb_constants(config, float(t), 1e-2f, kGradScale, 40.0f * kGradScale));
      });
    }
  }
}
#endif
