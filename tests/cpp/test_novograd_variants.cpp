// The AVX2+F16C NovoGrad span kernels against the portable ones (novograd_variants.h), bit for
// bit: both passes, over every (param, grad) dtype pair, both norms and both places of the
// weight decay. On a CPU with F16C the public spans take the F16C lanes for fp16/bf16, so this
// is the one test that runs the software-converting lanes on data of those types there.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/novograd_variants.h"
#include "novograd_math.h"
#include "span_test_values.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

// One copy of everything a step touches, and the last step's reduction; two of them, one per
// implementation, start equal.
struct State {
  Array param, grad;
  std::vector<float> exp_avg, master;
  float norm_avg = 1.5f;  // the tensor's running norm
  double reduction = 0.0;

  // Grads within fp16's range: one inf grad would make the tensor's norm, hence every update,
  // inf or NaN (the non-finite cases add their own).
  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false)),
        grad(grad_dtype, test_values(n, 2, nonfinite, /*beyond_fp16=*/false)),
        exp_avg(test_values(n, 3, false)),
        master(test_values(n, 1, false)) {}
};

bool same_state(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.exp_avg, b.exp_avg) &&
         same(a.master, b.master) && same(a.norm_avg, b.norm_avg) && same(a.reduction, b.reduction);
}

// One NovoGrad step of one implementation, as the CPU op runs it on one tensor: the reduction,
// the blend into the running norm, the update.
void novograd_step(bool use_avx2, State& s, bool master, bool write_grad, std::int64_t n,
                   const NovoGradStep& constants) {
  auto* norm = use_avx2 ? cpu::avx2::novograd_norm : cpu::portable::novograd_norm;
  auto* apply = use_avx2 ? cpu::avx2::novograd_apply : cpu::portable::novograd_apply;
  s.reduction = norm(s.grad.data(), s.grad.dtype, n, constants.grad_scale, constants.max_norm);
  // The op skips a step whose grads are not finite; run anyway, it keeps the old running norm,
  // so that the update stays finite where the grads are and the lanes' inf and NaN grads are
  // compared element by element.
  if (std::isfinite(s.reduction)) {
    s.norm_avg = novograd_blend(s.norm_avg, s.reduction, constants);
  }
  apply(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write_grad, s.exp_avg.data(),
        master ? s.master.data() : nullptr, n, constants,
        novograd_denominator(s.norm_avg, constants));
}

}  // namespace

TEST_CASE("AVX2+F16C novograd gives the portable kernel's bits, reductions and updates") {
  if (!cpu_runs_avx2_kernels()) return;
  for (bool max_norm : {false, true}) {
    for (bool reg_inside_moment : {false, true}) {
      // apex's defaults but for the two flags; the first of the three steps seeds the norm.
      const NovoGradConfig config{0.95,     0.98, 1e-8, 0.001, true, true, reg_inside_moment,
                                  max_norm, false};
      INFO("max_norm " << max_norm << " reg_inside_moment " << reg_inside_moment);
      compare_variants<State>(
          "novograd", [&](bool use_avx2, State& s, bool master, bool write, std::int64_t n, int t) {
            novograd_step(use_avx2, s, master, write, n,
                          make_novograd_constants(config, float(t), 1e-2f, kGradScale));
          });
    }
  }
}
#endif
