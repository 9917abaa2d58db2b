// The AVX2+F16C and AVX-512 LAMB span kernels against the portable ones (lamb_variants.h), bit
// for bit: both passes, over every (param, grad) dtype pair, with L2 and decoupled weight decay,
// with and without clipping and the trust ratio, and the master-free bf16 modes. On a CPU with
// F16C the public spans take the vector lanes for fp16/bf16, so this is the one test that runs
// the software-converting lanes on data of those types there. The sums of squares must be equal
// too: sixteen lanes add them in the eight-lane order (lamb_lanes.h), which sizes around the
// 128-element folds with 8 elements past the last sixteen-lane vector exercise.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_modes.h"
#include "cpu/lamb_variants.h"
#include "cpu/lanes_avx512.h"
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
  std::vector<std::uint16_t> extra;  // a master-free bf16 mode's second words
  double param_sq = 0.0, update_sq = 0.0;

  // Params within fp16's range: without a master an inf param makes the tensor's param norm,
  // hence the trust ratio and every update, inf or NaN. The masters go past it, so that their
  // stores into fp16 params overflow. Grads within it too, as the non-finite cases add their own.
  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false, /*beyond_fp16=*/false)),
        grad(grad_dtype, test_values(n, 2, nonfinite, /*beyond_fp16=*/false)),
        exp_avg(test_values(n, 3, false)),
        exp_avg_sq(squares(test_values(n, 4, false))),
        master(test_values(n, 1, false)),
        extra(static_cast<std::size_t>(n), 0) {}

  static std::vector<float> squares(std::vector<float> v) {
    for (float& x : v) x *= x;
    return v;
  }
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.exp_avg, b.exp_avg) &&
         same(a.exp_avg_sq, b.exp_avg_sq) && same(a.master, b.master) && a.extra == b.extra &&
         same(a.param_sq, b.param_sq) && same(a.update_sq, b.update_sq);
}

// One implementation's two passes.
struct LambKernels {
  const char* name;
  decltype(&cpu::portable::lamb_moments) moments;
  decltype(&cpu::portable::lamb_apply) apply;
  decltype(&cpu::portable::lamb_moments_bf16) moments_bf16;
  decltype(&cpu::portable::lamb_apply_bf16) apply_bf16;
};

const LambKernels kPortable{"portable", cpu::portable::lamb_moments, cpu::portable::lamb_apply,
                            cpu::portable::lamb_moments_bf16, cpu::portable::lamb_apply_bf16};

// The vector implementations this processor runs.
std::vector<LambKernels> vector_kernels() {
  std::vector<LambKernels> kernels;
  if (cpu_runs_avx2_kernels()) {
    kernels.push_back({"avx2", cpu::avx2::lamb_moments, cpu::avx2::lamb_apply,
                       cpu::avx2::lamb_moments_bf16, cpu::avx2::lamb_apply_bf16});
  }
  if (cpu::cpu_has_avx512()) {
    kernels.push_back({"avx512", cpu::avx512::lamb_moments, cpu::avx512::lamb_apply,
                       cpu::avx512::lamb_moments_bf16, cpu::avx512::lamb_apply_bf16});
  } else {
    WARN("this CPU has no AVX-512: the sixteen-lane LAMB does not run here");
  }
  return kernels;
}

// The trust ratio the op forms from a step's sums. The op skips a step whose grads are not
// finite; run anyway with the plain learning rate, so that the update stays finite where the
// moments are and the lanes' inf and NaN grads are compared element by element.
float ratio_of(const State& s, const LambStep& constants) {
  const float ratio = lamb_ratio(static_cast<float>(std::sqrt(s.param_sq)),
                                 static_cast<float>(std::sqrt(s.update_sq)), constants);
  return std::isfinite(ratio) ? ratio : constants.lr;
}

// One LAMB step of one implementation, as the CPU op runs it on a one-span tensor: the moments
// and sums, the trust ratio, the update.
void lamb_step(const LambKernels& kernels, State& s, bool master, bool write_grad, std::int64_t n,
               const LambStep& constants) {
  float* masters = master ? s.master.data() : nullptr;
  s.param_sq = s.update_sq = 0.0;
  kernels.moments(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write_grad,
                  s.exp_avg.data(), s.exp_avg_sq.data(), masters, n, constants, &s.param_sq,
                  &s.update_sq);
  kernels.apply(s.param.data(), s.param.dtype, s.exp_avg.data(), s.exp_avg_sq.data(), masters, n,
                constants, ratio_of(s, constants));
}

// The same in a master-free bf16 mode, the span starting at element 1000 of its param (the
// stochastic rounding is keyed by the true index).
void lamb_bf16_step(const LambKernels& kernels, State& s, MasterMode mode, bool write_grad,
                    std::int64_t n, int t, const LambStep& constants) {
  const cpu::Bf16Span span{mode, mode == MasterMode::kStochastic ? nullptr : s.extra.data(),
                           rounding_key(7, float(t), 3), 1000};
  auto* param = static_cast<std::uint16_t*>(s.param.data());
  s.param_sq = s.update_sq = 0.0;
  kernels.moments_bf16(param, span, s.grad.data(), s.grad.dtype, write_grad, s.exp_avg.data(),
                       s.exp_avg_sq.data(), n, constants, &s.param_sq, &s.update_sq);
  kernels.apply_bf16(param, span, s.exp_avg.data(), s.exp_avg_sq.data(), n, constants,
                     ratio_of(s, constants));
}

// L2 decay, decoupled decay, the trust ratio without decay (use_nvlamb), and none of them with
// neither bias correction nor grad averaging.
std::vector<LambConfig> configs(double max_grad_norm) {
  return {
      {0.9, 0.999, 1e-6, 0.01, max_grad_norm, false, true, true, false},
      {0.9, 0.999, 1e-6, 0.01, max_grad_norm, true, true, true, false},
      {0.9, 0.999, 1e-6, 0.0, max_grad_norm, true, true, true, true},
      {0.9, 0.999, 1e-6, 0.0, max_grad_norm, true, false, false, false},
  };
}

// The variant sizes, and ones that end 8 elements past a sixteen-lane vector at and inside a
// fold (136, 200), at a fold's end (1280) and past several folds (1288, 1301).
const std::vector<std::int64_t> kLambSizes = {1,   7,   8,   9,    23,   136,  200,
                                              511, 512, 513, 1031, 1280, 1288, 1301};

}  // namespace

TEST_CASE("AVX2+F16C and AVX-512 LAMB give the portable kernel's bits, moments, sums, updates") {
  for (const LambKernels& kernels : vector_kernels()) {
    // Clipping at 1 clips every step: the grad norm passed is 40 unscaled.
    for (double max_grad_norm : {0.0, 1.0}) {
      for (const LambConfig& config : configs(max_grad_norm)) {
        INFO(kernels.name << " max_grad_norm " << max_grad_norm << " weight_decay "
                          << config.weight_decay << " adam_w_mode " << config.adam_w_mode
                          << " use_nvlamb " << config.use_nvlamb << " bias_correction "
                          << config.bias_correction);
        compare_variants<State>(
            "lamb",
            [&](bool vector, State& s, bool master, bool write, std::int64_t n, int t) {
              lamb_step(
                  vector ? kernels : kPortable, s, master, write, n,
                  make_lamb_constants(config, float(t), 1e-2f, kGradScale, 40.0f * kGradScale));
            },
            kLambSizes);
      }
    }
  }
}

TEST_CASE("AVX2 and AVX-512 LAMB give the portable bits in the master-free bf16 modes") {
  for (const LambKernels& kernels : vector_kernels()) {
    for (const MasterMode mode :
         {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit}) {
      for (const LambConfig& config : configs(1.0)) {
        for (const std::int64_t n : kLambSizes) {
          for (bool nonfinite : {false, true}) {
            for (bool write : {false, true}) {
              INFO(kernels.name << " mode " << int(mode) << " weight_decay " << config.weight_decay
                                << " n " << n << " nonfinite " << nonfinite << " write " << write);
              State a(DType::kBFloat16, DType::kBFloat16, n, nonfinite), b = a;
              for (int t = 0; t < 3; ++t) {
                const LambStep constants =
                    make_lamb_constants(config, float(t), 1e-2f, kGradScale, 40.0f * kGradScale);
                lamb_bf16_step(kernels, a, mode, write, n, t, constants);
                lamb_bf16_step(kPortable, b, mode, write, n, t, constants);
                REQUIRE(same_state(a, b));
              }
            }
          }
        }
      }
    }
  }
}
#endif
