// CPU Adam/AdamW, SGD and Adagrad span kernels: one pass reads the gradient, updates the
// fp32 state and writes the parameter (and its master) back. This file holds the
// portable loops and the choice between them and the AVX2+F16C loops of
// optimizer_kernels_avx2.cpp, made at run time from what the processor supports.
#include "cpu_kernels.h"
#include "lanes_avx512.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {
namespace portable {
namespace {

// The 8-lane loops with software conversions, cloned for AVX2 (fp32 then runs on AVX registers)
// and the baseline (fp16/bf16 on CPUs without F16C, and every dtype off x86).
struct Kernels {
  template <bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param, typename Grad>
  AMPFUSE_CPU_CLONES static void adam(Param* param, Grad* grad, float* exp_avg, float* exp_avg_sq,
                                      float* max_exp_avg_sq, float* master, std::int64_t n,
                                      const AdamStep& step) {
    adam_lanes<PortableLanes, kMaster, kWriteGrad, kAmsgrad>(param, grad, exp_avg, exp_avg_sq,
                                                             max_exp_avg_sq, master, n, step);
  }

  template <bool kMaster, bool kWriteGrad, bool kMomentum, typename Param, typename Grad>
  AMPFUSE_CPU_CLONES static void sgd(Param* param, Grad* grad, float* momentum_buffer,
                                     float* master, std::int64_t n, const SgdStep& step) {
    sgd_lanes<PortableLanes, kMaster, kWriteGrad, kMomentum>(param, grad, momentum_buffer, master,
                                                             n, step);
  }

  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_CPU_CLONES static void adagrad(Param* param, Grad* grad, float* sum, float* master,
                                         std::int64_t n, const AdagradStep& step) {
    adagrad_lanes<PortableLanes, kMaster, kWriteGrad>(param, grad, sum, master, n, step);
  }
};

}  // namespace

void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
          const AdamStep& step) {
  adam_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                    max_exp_avg_sq, master, n, step);
}

void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step) {
  sgd_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, momentum_buffer, master, n,
                   step);
}

void adagrad(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
             float* sum, float* master, std::int64_t n, const AdagradStep& step) {
  adagrad_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, sum, master, n, step);
}

}  // namespace portable

void adam_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
               float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
               std::int64_t n, const AdamStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {  // every dtype: sixteen lanes gain for fp32 too
    avx512::adam(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                 max_exp_avg_sq, master, n, step);
    return;
  }
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::adam(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
               max_exp_avg_sq, master, n, step);
    return;
  }
#endif
  portable::adam(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                 max_exp_avg_sq, master, n, step);
}

void sgd_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
              float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::sgd(param, param_dtype, grad, grad_dtype, write_grad, momentum_buffer, master, n, step);
    return;
  }
#endif
  portable::sgd(param, param_dtype, grad, grad_dtype, write_grad, momentum_buffer, master, n, step);
}

void adagrad_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                  float* sum, float* master, std::int64_t n, const AdagradStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::adagrad(param, param_dtype, grad, grad_dtype, write_grad, sum, master, n, step);
    return;
  }
#endif
  portable::adagrad(param, param_dtype, grad, grad_dtype, write_grad, sum, master, n, step);
}

}  // namespace ampfuse::kernels::cpu
