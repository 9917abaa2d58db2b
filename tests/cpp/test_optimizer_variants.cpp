// The AVX2+F16C Adam, SGD and Adagrad span kernels against the portable ones, bit for bit, over
// every (param, grad) dtype pair and every option that changes the arrays touched or the math.
#include <catch2/catch.hpp>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu/lanes_avx512.h"
#include "cpu/optimizer_variants.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

// One copy of everything a step touches; two of them, one per implementation, start equal.
struct State {
  Array param, grad;
  // Adam's moments and AMSGrad max, SGD's momentum (first), Adagrad's sum (second: not negative)
  std::vector<float> first, second, third, master;

  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false)),
        grad(grad_dtype, test_values(n, 2, nonfinite)),
        first(test_values(n, 3, false)),
        second(test_values(n, 4, false)),
        third(test_values(n, 5, false)),
        master(test_values(n, 1, false)) {
    for (auto& x : second) x *= x;  // second moments are not negative
    for (auto& x : third) x *= x;
  }
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.first, b.first) &&
         same(a.second, b.second) && same(a.third, b.third) && same(a.master, b.master);
}

}  // namespace

using AdamKernel = void (*)(void*, DType, void*, DType, bool, float*, float*, float*, float*,
                            std::int64_t, const AdamStep&);

TEST_CASE("AVX2+F16C and AVX-512 adam give the portable kernel's bits") {
  std::vector<std::pair<const char*, AdamKernel>> kernels;
  if (cpu_runs_avx2_kernels()) kernels.push_back({"avx2", avx2::adam});
  if (cpu_has_avx512()) {
    kernels.push_back({"avx512", avx512::adam});
  } else {
    WARN("this CPU has no AVX-512: the sixteen-lane Adam does not run here");
  }
  for (const auto& [name, kernel] : kernels) {
    for (bool adam_w : {false, true}) {
      for (bool amsgrad : {false, true}) {
        for (bool maximize : {false, true}) {
          // beta1 0.9 and 0.3 take the two lerp formulas.
          const AdamConfig config{
              adam_w ? 0.9 : 0.3, 0.999, 1e-8, 0.01, adam_w, true, amsgrad, maximize};
          INFO(name << " adam_w " << adam_w << " amsgrad " << amsgrad << " maximize " << maximize);
          compare_variants<State>(
              "adam", [&](bool vector, State& s, bool master, bool write, std::int64_t n, int t) {
                const AdamStep step = make_step_constants(config, float(t), 1e-3f, 1000.0f);
                AdamKernel run = vector ? kernel : portable::adam;
                run(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write,
                    s.first.data(), s.second.data(), amsgrad ? s.third.data() : nullptr,
                    master ? s.master.data() : nullptr, n, step);
              });
        }
      }
    }
  }
}

// Without a loss scale (grad_scale 1) the lane loops skip the unscale division
// (optimizer_math.h's unscale_grad) while the scalar loop still divides; x / 1 is x, so a span
// stepped at once and the same span stepped one element per call (all scalar) agree bit for bit.
static void* element(Array& a, std::int64_t i) {
  return a.dtype == DType::kFloat32 ? static_cast<void*>(a.single.data() + i)
                                    : static_cast<void*>(a.half.data() + i);
}

static float* element_or_null(std::vector<float>& v, bool used, std::int64_t i) {
  return used ? v.data() + i : nullptr;
}

TEST_CASE("without a loss scale, lanes that skip the division give the scalar loop's bits") {
  std::vector<std::pair<const char*, AdamKernel>> kernels = {{"portable", portable::adam}};
  if (cpu_runs_avx2_kernels()) kernels.push_back({"avx2", avx2::adam});
  if (cpu_has_avx512()) kernels.push_back({"avx512", avx512::adam});
  for (const auto& [name, kernel] : kernels) {
    for (bool amsgrad : {false, true}) {
      const AdamConfig config{0.9, 0.999, 1e-8, 0.01, true, true, amsgrad, false};
      INFO(name << " amsgrad " << amsgrad);
      compare_variants<State>("adam, grad_scale 1", [&](bool whole, State& s, bool master,
                                                        bool write, std::int64_t n, int t) {
        const AdamStep step = make_step_constants(config, float(t), 1e-3f, 1.0f);
        const std::int64_t len = whole ? n : 1;
        for (std::int64_t i = 0; i < n; i += len) {
          kernel(element(s.param, i), s.param.dtype, element(s.grad, i), s.grad.dtype, write,
                 s.first.data() + i, s.second.data() + i, element_or_null(s.third, amsgrad, i),
                 element_or_null(s.master, master, i), len, step);
        }
      });
    }
  }
}

TEST_CASE("AVX2+F16C sgd gives the portable kernel's bits") {
  if (!cpu_runs_avx2_kernels()) return;
  for (bool momentum : {false, true}) {
    for (bool nesterov : {false, true}) {
      for (bool wd_after_momentum : {false, true}) {
        const SgdConfig config{
            momentum ? 0.9 : 0.0, nesterov ? 0.0 : 0.1, 0.01, nesterov, !nesterov,
            wd_after_momentum};
        INFO("momentum " << momentum << " nesterov " << nesterov << " wd_after_momentum "
                         << wd_after_momentum);
        compare_variants<State>(
            "sgd", [&](bool use_avx2, State& s, bool master, bool write, std::int64_t n, int t) {
              const SgdStep step = make_step_constants(config, float(t), 1e-3f, 1000.0f);
              auto* run = use_avx2 ? avx2::sgd : portable::sgd;
              run(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write,
                  momentum ? s.first.data() : nullptr, master ? s.master.data() : nullptr, n, step);
            });
      }
    }
  }
}

TEST_CASE("AVX2+F16C adagrad gives the portable kernel's bits") {
  if (!cpu_runs_avx2_kernels()) return;
  // No decay, the decay in the grad (torch) and in the step (apex's adagrad_w_mode).
  for (double weight_decay : {0.0, 0.01}) {
    for (bool decoupled : {false, true}) {
      if (weight_decay == 0.0 && decoupled) continue;  // the same update as not decoupled
      for (bool maximize : {false, true}) {
        const AdagradConfig config{0.01, weight_decay, 1e-10, decoupled, maximize};
        INFO("weight_decay " << weight_decay << " decoupled " << decoupled << " maximize "
                             << maximize);
        compare_variants<State>("adagrad", [&](bool use_avx2, State& s, bool master, bool write,
                                               std::int64_t n, int t) {
          const AdagradStep step = make_step_constants(config, float(t), 1e-2f, 1000.0f);
          auto* run = use_avx2 ? avx2::adagrad : portable::adagrad;
          run(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write, s.second.data(),
              master ? s.master.data() : nullptr, n, step);
        });
      }
    }
  }
}
#endif
