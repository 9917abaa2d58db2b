// The fused AVX2+FMA Adam step with 8-bit block-coded moments (adam_coded_avx2.cpp) against the
// portable one (decode, the fp32-state span kernel, encode per block), bit for bit: every
// (param, grad) dtype pair, size, master, grad write-back and non-finite grads of the fp32-master
// kernels' comparison, each master-free bf16 mode, both codes, AMSGrad, Adam and AdamW.
#include <catch2/catch.hpp>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_modes.h"
#include "coded_test_values.h"
#include "cpu/coded_moments.h"
#include "cpu/cpu_kernels.h"
#include "cpu/lanes_avx512.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
namespace {

// One copy of everything a step touches; two of them, one per implementation, start equal.
// The moments are coded with `code`, fixed per test case through State::code.
struct State {
  static inline StateCode code = StateCode::kInt8;
  Array param, grad;
  std::vector<float> master;
  std::vector<std::uint16_t> extra;  // a master-free bf16 mode's second words
  Coded exp_avg, exp_avg_sq, max_exp_avg_sq;

  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false)),
        grad(grad_dtype, test_values(n, 2, nonfinite)),
        master(test_values(n, 1, false)),
        extra(static_cast<std::size_t>(n), 0),
        exp_avg(test_values(n, 3, false), code, false),
        exp_avg_sq(squares(test_values(n, 4, false)), code, true),
        max_exp_avg_sq(squares(test_values(n, 5, false)), code, true) {}

  CodedMoments moments(bool amsgrad) {
    return {code,
            exp_avg.codes.data(),
            exp_avg.scales.data(),
            exp_avg_sq.codes.data(),
            exp_avg_sq.scales.data(),
            amsgrad ? max_exp_avg_sq.codes.data() : nullptr,
            amsgrad ? max_exp_avg_sq.scales.data() : nullptr};
  }
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.master, b.master) &&
         a.extra == b.extra && a.exp_avg == b.exp_avg && a.exp_avg_sq == b.exp_avg_sq &&
         a.max_exp_avg_sq == b.max_exp_avg_sq;
}

using CodedSpan = void (*)(void*, DType, void*, DType, bool, const CodedMoments&, float*,
                           const Bf16Span*, std::int64_t, const AdamStep&);

// The fused steps this processor runs, eight lanes (AVX2) and sixteen (AVX-512).
std::vector<std::pair<const char*, CodedSpan>> fused_steps() {
  std::vector<std::pair<const char*, CodedSpan>> steps;
  if (avx2_fma::supported()) steps.push_back({"avx2_fma", avx2_fma::adam_coded_span});
  if (cpu_has_avx512()) steps.push_back({"avx512", avx512::adam_coded_span});
  if (steps.empty()) WARN("this CPU has no AVX2+FMA+F16C: only the portable coded Adam runs here");
  return steps;
}

// The fused step under test: set by each test case's loop over fused_steps().
CodedSpan fused_step = nullptr;

void run(bool fused, State& s, bool master, bool write, const Bf16Span* bf16, bool amsgrad,
         std::int64_t n, const AdamStep& step) {
  CodedSpan span = fused ? fused_step : portable::adam_coded_span;
  span(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write, s.moments(amsgrad),
       master ? s.master.data() : nullptr, bf16, n, step);
}

AdamConfig config_for(bool adam_w, bool amsgrad) {
  // beta1 0.9 and 0.3 take torch's two lerp formulas; Adam's weight decay is L2, AdamW's
  // decoupled.
  return AdamConfig{adam_w ? 0.9 : 0.3, 0.999, 1e-8, 0.01, adam_w, true, amsgrad, !adam_w};
}

}  // namespace

TEST_CASE("fused coded Adam (AVX2, AVX-512) gives the portable coded step's bits") {
  for (const auto& [name, span] : fused_steps()) {
    fused_step = span;
    INFO("fused step " << name);
    for (const StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      State::code = code;
      for (bool adam_w : {false, true}) {
        for (bool amsgrad : {false, true}) {
          const AdamConfig config = config_for(adam_w, amsgrad);
          INFO("code " << int(code) << " adam_w " << adam_w << " amsgrad " << amsgrad);
          compare_variants<State>("coded adam", [&](bool fused, State& s, bool master, bool write,
                                                    std::int64_t n, int t) {
            run(fused, s, master, write, nullptr, amsgrad, n,
                make_step_constants(config, float(t), 1e-3f, 1000.0f));
          });
        }
      }
    }
  }
}

TEST_CASE(
    "fused coded Adam (AVX2, AVX-512) gives the portable bits in the master-free bf16 modes") {
  const std::int64_t sizes[] = {1, 9, 17, 255, 256, 257, 1031};
  for (const auto& [name, span] : fused_steps()) {
    fused_step = span;
    INFO("fused step " << name);
    for (const StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      State::code = code;
      for (const MasterMode mode :
           {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit}) {
        for (bool amsgrad : {false, true}) {
          for (const std::int64_t n : sizes) {
            for (bool nonfinite : {false, true}) {
              for (bool write : {false, true}) {
                INFO("code " << int(code) << " mode " << int(mode) << " amsgrad " << amsgrad
                             << " n " << n << " nonfinite " << nonfinite << " write " << write);
                State a(DType::kBFloat16, DType::kBFloat16, n, nonfinite), b = a;
                for (int t = 0; t < 3; ++t) {
                  // A span that starts at element 1000 of its param: stochastic rounding is keyed
                  // by the true indices, block by block in the fused step.
                  const Bf16Span span_a{mode,
                                        mode == MasterMode::kStochastic ? nullptr : a.extra.data(),
                                        rounding_key(7, float(t), 3), 1000};
                  Bf16Span span_b = span_a;
                  span_b.extra = mode == MasterMode::kStochastic ? nullptr : b.extra.data();
                  const AdamStep step =
                      make_step_constants(config_for(true, amsgrad), float(t), 1e-3f, 384.0f);
                  run(true, a, false, write, &span_a, amsgrad, n, step);
                  run(false, b, false, write, &span_b, amsgrad, n, step);
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
