// The AVX2+F16C Adam, SGD and Adagrad span kernels (see optimizer_variants.h). Eight elements at
// a time: fp16 and bf16 are widened to fp32 with the vector conversions of vec_avx2.h, the shared
// element update (optimizer_math.h) runs on eight lanes at once (lanes8.h), and the results are
// narrowed back, in one pass over the arrays. The vector conversions give the same bits as
// half_convert.h's and each lane rounds as the scalar update does, so results match portable::
// exactly. The last n % 8 elements run the scalar loop on the arrays themselves.
//
// (Until 2026-11 these kernels widened a 512-element block into an fp32 buffer, ran the scalar
// loop on it and narrowed it back: three more passes through L1 per block, which made fp16 SGD
// 1.6x slower than torch's fp32 SGD on data in cache.)
#include "optimizer_variants.h"

#ifdef AMPFUSE_HAVE_AVX2_PATH

namespace ampfuse::kernels::cpu::avx2 {
namespace {

struct Kernels {
  template <bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param, typename Grad>
  AMPFUSE_AVX2 static void adam(Param* param, Grad* grad, float* exp_avg, float* exp_avg_sq,
                                float* max_exp_avg_sq, float* master, std::int64_t n,
                                const AdamStep& step) {
    adam_lanes<F16cLanes, kMaster, kWriteGrad, kAmsgrad>(param, grad, exp_avg, exp_avg_sq,
                                                         max_exp_avg_sq, master, n, step);
  }

  template <bool kMaster, bool kWriteGrad, bool kMomentum, typename Param, typename Grad>
  AMPFUSE_AVX2 static void sgd(Param* param, Grad* grad, float* momentum_buffer, float* master,
                               std::int64_t n, const SgdStep& step) {
    sgd_lanes<F16cLanes, kMaster, kWriteGrad, kMomentum>(param, grad, momentum_buffer, master, n,
                                                         step);
  }

  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_AVX2 static void adagrad(Param* param, Grad* grad, float* sum, float* master,
                                   std::int64_t n, const AdagradStep& step) {
    adagrad_lanes<F16cLanes, kMaster, kWriteGrad>(param, grad, sum, master, n, step);
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

}  // namespace ampfuse::kernels::cpu::avx2

#endif
