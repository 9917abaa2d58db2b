// The fused LAMB passes over 8-bit coded moments (lamb_coded_avx2.cpp, lamb_coded_avx512.cpp)
// against the portable ones (decode into fp32 spans, the portable fp32 LAMB spans, encode), bit
// for bit: codes, scales, params, masters, grads and both sums of squares, over every (param,
// grad) dtype pair, size, master, grad write-back and non-finite grads of the variant
// comparisons, each master-free bf16 mode, both codes, L2 and decoupled decay, clipping.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_modes.h"
#include "coded_test_values.h"
#include "cpu/coded_moments.h"
#include "cpu/lamb_coded.h"
#include "cpu/lanes_avx512.h"
#include "span_test_values.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
namespace {

// One copy of everything a step touches and the last step's sums; two of them, one per
// implementation, start equal. The moments are coded with State::code, fixed per test case.
struct State {
  static inline StateCode code = StateCode::kInt8;
  Array param, grad;
  std::vector<float> master;
  std::vector<std::uint16_t> extra;  // a master-free bf16 mode's second words
  Coded exp_avg, exp_avg_sq;
  double param_sq = 0.0, update_sq = 0.0;

  // Params and grads within fp16's range, as in test_lamb_variants.cpp: an inf param makes the
  // trust ratio, and with it every update, inf or NaN.
  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false, /*beyond_fp16=*/false)),
        grad(grad_dtype, test_values(n, 2, nonfinite, /*beyond_fp16=*/false)),
        master(test_values(n, 1, false)),
        extra(static_cast<std::size_t>(n), 0),
        exp_avg(test_values(n, 3, false), code, false),
        exp_avg_sq(squares(test_values(n, 4, false)), code, true) {}

  CodedMoments moments() {
    return {code,
            exp_avg.codes.data(),
            exp_avg.scales.data(),
            exp_avg_sq.codes.data(),
            exp_avg_sq.scales.data(),
            nullptr,
            nullptr};
  }
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.master, b.master) &&
         a.extra == b.extra && a.exp_avg == b.exp_avg && a.exp_avg_sq == b.exp_avg_sq &&
         same(a.param_sq, b.param_sq) && same(a.update_sq, b.update_sq);
}

struct Passes {
  const char* name;
  decltype(&portable::lamb_coded_sums_span) sums;
  decltype(&portable::lamb_coded_step_span) step;
};

// The fused passes this processor runs, eight lanes (AVX2) and sixteen (AVX-512).
std::vector<Passes> fused_passes() {
  std::vector<Passes> passes;
  if (avx2_fma::supported()) {
    passes.push_back({"avx2_fma", avx2_fma::lamb_coded_sums_span, avx2_fma::lamb_coded_step_span});
  }
  if (cpu_has_avx512()) {
    passes.push_back({"avx512", avx512::lamb_coded_sums_span, avx512::lamb_coded_step_span});
  }
  if (passes.empty()) WARN("this CPU has no AVX2+FMA+F16C: only the portable coded LAMB runs");
  return passes;
}

const Passes kPortable{"portable", portable::lamb_coded_sums_span, portable::lamb_coded_step_span};

// One step as the op runs it on a one-span tensor: the sums, the trust ratio (the plain learning
// rate where non-finite grads make it so, for the reason test_lamb_variants.cpp gives), the step.
void run(const Passes& passes, State& s, bool master, bool write, const Bf16Span* bf16,
         std::int64_t n, const LambStep& step) {
  float* masters = master ? s.master.data() : nullptr;
  s.param_sq = s.update_sq = 0.0;
  passes.sums(s.param.data(), s.param.dtype, bf16, masters, s.grad.data(), s.grad.dtype,
              s.moments(), n, step, &s.param_sq, &s.update_sq);
  float ratio = lamb_ratio(static_cast<float>(std::sqrt(s.param_sq)),
                           static_cast<float>(std::sqrt(s.update_sq)), step);
  if (!std::isfinite(ratio)) ratio = step.lr;
  passes.step(s.param.data(), s.param.dtype, bf16, masters, s.grad.data(), s.grad.dtype, write,
              s.moments(), n, step, ratio);
}

std::vector<LambConfig> configs() {
  // L2 decay with clipping (the grad norm passed is 40 unscaled), decoupled decay, and the trust
  // ratio without decay and without bias correction or grad averaging.
  return {{0.9, 0.999, 1e-6, 0.01, 1.0, false, true, true, false},
          {0.9, 0.999, 1e-6, 0.01, 0.0, true, true, true, false},
          {0.9, 0.999, 1e-6, 0.0, 0.0, true, false, false, true}};
}

// Around the 128-element folds and 256-element blocks: short last blocks with and without eight
// elements past the last sixteen-lane vector, a tail that starts a block (257, 264).
const std::vector<std::int64_t> kSizes = {1,   7,   8,   9,   23,  136,  200,  255,
                                          256, 257, 264, 511, 513, 1031, 1288, 1301};

}  // namespace

TEST_CASE("fused coded LAMB (AVX2, AVX-512) gives the portable coded passes' bits") {
  for (const Passes& fused : fused_passes()) {
    for (const StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      State::code = code;
      for (const LambConfig& config : configs()) {
        INFO(fused.name << " code " << int(code) << " weight_decay " << config.weight_decay
                        << " adam_w_mode " << config.adam_w_mode);
        compare_variants<State>(
            "coded lamb",
            [&](bool vector, State& s, bool master, bool write, std::int64_t n, int t) {
              run(vector ? fused : kPortable, s, master, write, nullptr, n,
                  make_lamb_constants(config, float(t), 1e-2f, kGradScale, 40.0f * kGradScale));
            },
            kSizes);
      }
    }
  }
}

TEST_CASE("fused coded LAMB (AVX2, AVX-512) gives the portable bits in the master-free modes") {
  for (const Passes& fused : fused_passes()) {
    for (const StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      State::code = code;
      for (const MasterMode mode :
           {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit}) {
        for (const LambConfig& config : configs()) {
          for (const std::int64_t n : kSizes) {
            for (bool nonfinite : {false, true}) {
              for (bool write : {false, true}) {
                INFO(fused.name << " code " << int(code) << " mode " << int(mode)
                                << " weight_decay " << config.weight_decay << " n " << n
                                << " nonfinite " << nonfinite << " write " << write);
                State a(DType::kBFloat16, DType::kBFloat16, n, nonfinite), b = a;
                for (int t = 0; t < 3; ++t) {
                  // The span starts at element 1024 of its param: stochastic rounding is keyed by
                  // the true indices.
                  const bool stochastic = mode == MasterMode::kStochastic;
                  const Bf16Span span_a{mode, stochastic ? nullptr : a.extra.data(),
                                        rounding_key(7, float(t), 3), 1024};
                  Bf16Span span_b = span_a;
                  span_b.extra = stochastic ? nullptr : b.extra.data();
                  const LambStep step =
                      make_lamb_constants(config, float(t), 1e-2f, kGradScale, 40.0f * kGradScale);
                  run(fused, a, false, write, &span_a, n, step);
                  run(kPortable, b, false, write, &span_b, n, step);
                  REQUIRE(same_state(a, b));
                }
              }
            }
          }
        }
      }
    }
  }
}
#endif
