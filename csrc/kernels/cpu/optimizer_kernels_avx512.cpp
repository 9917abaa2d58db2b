// The fp32-state Adam span kernel sixteen lanes at a time, for processors with AVX-512: the very
// loop of optimizer_kernels_avx2.cpp (adam_lanes) at the width of its storage policy, Lanes512
// (lanes_avx512.h), whose conversions give vec_avx2.h's bits, so the results are portable::'s
// exactly (tests/cpp/test_optimizer_variants.cpp). adam_span picks it first. Adam only: its
// division and square root per element make it the kernel bound by arithmetic (SGD and Adagrad
// are bound by memory at eight lanes already).
#include "optimizer_variants.h"

#ifdef AMPFUSE_HAVE_AVX2_PATH

#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu::avx512 {
namespace {

struct Kernels {
  template <bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param, typename Grad>
  AMPFUSE_AVX512_TARGET static void adam(Param* param, Grad* grad, float* exp_avg,
                                         float* exp_avg_sq, float* max_exp_avg_sq, float* master,
                                         std::int64_t n, const AdamStep& step) {
    adam_lanes<Lanes512, kMaster, kWriteGrad, kAmsgrad>(param, grad, exp_avg, exp_avg_sq,
                                                        max_exp_avg_sq, master, n, step);
  }
};

}  // namespace

void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
          const AdamStep& step) {
  adam_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                    max_exp_avg_sq, master, n, step);
}

}  // namespace ampfuse::kernels::cpu::avx512

#endif
