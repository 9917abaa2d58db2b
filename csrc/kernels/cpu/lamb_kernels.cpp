// The CPU LAMB span kernels (cpu_kernels.h) at eight lanes, and the choice between them and the
// sixteen-lane ones (lamb_kernels_avx512.cpp). The loops are lamb_lanes.h's, the two passes of
// lamb_math.h; fp16/bf16 reach the lanes through F16C where the processor has it (avx2::) and
// through software conversions elsewhere (portable::, cloned for AVX2 so fp32 runs on AVX
// registers everywhere); all give the same bits (lamb_variants.h). bf16 params of the
// master-free modes (master_weights "stochastic", "kahan", "split") run the same loops, reading
// and writing the param through bf16_lanes.h (and bf16_span.h for the scalar end).
#include "cpu_kernels.h"
#include "lamb_dispatch.h"
#include "lamb_variants.h"
#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu {
namespace portable {
namespace {

// The 8-lane loops with software conversions, cloned for AVX2 (fp32 then runs on AVX registers)
// and the baseline (fp16/bf16 on CPUs without F16C, and every dtype off x86).
struct Kernels {
  template <bool kWriteGrad, typename Source, typename Grad>
  AMPFUSE_CPU_CLONES static void moments(Source param, Grad* grad, float* exp_avg,
                                         float* exp_avg_sq, std::int64_t n, const LambStep& step,
                                         SquareSums& sums) {
    FloatLambMoments moments{exp_avg, exp_avg_sq};
    lamb_moments_lanes<PortableLanes, kWriteGrad>(param, grad, moments, n, step, sums);
  }

  template <typename Source>
  AMPFUSE_CPU_CLONES static void apply(Source param, const float* exp_avg, const float* exp_avg_sq,
                                       std::int64_t n, const LambStep& step, float ratio) {
    lamb_apply_lanes<PortableLanes>(param, exp_avg, exp_avg_sq, n, step, ratio);
  }
};

}  // namespace

void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                            master, n, step, param_sq, update_sq);
}

void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_any<Kernels>(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

void lamb_moments_bf16(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                       DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_bf16_any<Kernels, PortableWords>(param, bf16, grad, grad_dtype, write_grad, exp_avg,
                                                exp_avg_sq, n, step, param_sq, update_sq);
}

void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_bf16_any<Kernels, PortableWords>(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
}

}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace avx2 {
namespace {

struct Kernels {
  template <bool kWriteGrad, typename Source, typename Grad>
  AMPFUSE_AVX2 static void moments(Source param, Grad* grad, float* exp_avg, float* exp_avg_sq,
                                   std::int64_t n, const LambStep& step, SquareSums& sums) {
    FloatLambMoments moments{exp_avg, exp_avg_sq};
    lamb_moments_lanes<F16cLanes, kWriteGrad>(param, grad, moments, n, step, sums);
  }

  template <typename Source>
  AMPFUSE_AVX2 static void apply(Source param, const float* exp_avg, const float* exp_avg_sq,
                                 std::int64_t n, const LambStep& step, float ratio) {
    lamb_apply_lanes<F16cLanes>(param, exp_avg, exp_avg_sq, n, step, ratio);
  }
};

}  // namespace

void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                            master, n, step, param_sq, update_sq);
}

void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_any<Kernels>(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

void lamb_moments_bf16(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                       DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_bf16_any<Kernels, Avx2Words>(param, bf16, grad, grad_dtype, write_grad, exp_avg,
                                            exp_avg_sq, n, step, param_sq, update_sq);
}

void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_bf16_any<Kernels, Avx2Words>(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
}

}  // namespace avx2
#endif

void lamb_moments_span(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                       bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {
    avx512::lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                         master, n, step, param_sq, update_sq);
    return;
  }
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                       master, n, step, param_sq, update_sq);
    return;
  }
#endif
  portable::lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                         master, n, step, param_sq, update_sq);
}

void lamb_apply_span(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                     float* master, std::int64_t n, const LambStep& step, float ratio) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {
    avx512::lamb_apply(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
    return;
  }
  if (use_avx2(param_dtype, param_dtype)) {
    avx2::lamb_apply(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
    return;
  }
#endif
  portable::lamb_apply(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

// The bf16 modes run the avx512:: loops where the processor has AVX-512, else the avx2:: ones
// (F16C grads, AVX2 word moves) where it has AVX2 and F16C, whatever the grad dtype, and the
// portable ones elsewhere. Every variant adds in the same order, so "split" matches
// master_weights=True whichever variant that one ran.
void lamb_moments_bf16_span(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                            DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                            std::int64_t n, const LambStep& step, double* param_sq,
                            double* update_sq) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {
    avx512::lamb_moments_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq, n,
                              step, param_sq, update_sq);
    return;
  }
  if (cpu_has_avx2_f16c()) {
    avx2::lamb_moments_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq, n, step,
                            param_sq, update_sq);
    return;
  }
#endif
  portable::lamb_moments_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq, n,
                              step, param_sq, update_sq);
}

void lamb_apply_bf16_span(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                          const float* exp_avg_sq, std::int64_t n, const LambStep& step,
                          float ratio) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {
    avx512::lamb_apply_bf16(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
    return;
  }
  if (cpu_has_avx2_f16c()) {
    avx2::lamb_apply_bf16(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
    return;
  }
#endif
  portable::lamb_apply_bf16(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
}

}  // namespace ampfuse::kernels::cpu
