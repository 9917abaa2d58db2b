// The fp32-state LAMB span kernels sixteen lanes at a time, for processors with AVX-512: the
// loops of lamb_lanes.h at the width of Lanes512 and Avx512Words (lanes_avx512.h), whose
// conversions give the eight-lane kernels' bits. The sums of squares keep the eight-lane order
// (lamb_lanes.h's LaneOrderSums), so the trust ratios, and with them the params, are portable::'s
// exactly (tests/cpp/test_lamb_variants.cpp). LAMB forms the update's division and square root
// in both passes, so like Adam it is bound by arithmetic at eight lanes.
#include "lamb_variants.h"

#ifdef AMPFUSE_HAVE_AVX2_PATH

#include "lamb_dispatch.h"
#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu::avx512 {
namespace {

struct Kernels {
  template <bool kWriteGrad, typename Source, typename Grad>
  AMPFUSE_AVX512_TARGET static void moments(Source param, Grad* grad, float* exp_avg,
                                            float* exp_avg_sq, std::int64_t n, const LambStep& step,
                                            SquareSums& sums) {
    FloatLambMoments moments{exp_avg, exp_avg_sq};
    lamb_moments_lanes<Lanes512, kWriteGrad>(param, grad, moments, n, step, sums);
  }

  template <typename Source>
  AMPFUSE_AVX512_TARGET static void apply(Source param, const float* exp_avg,
                                          const float* exp_avg_sq, std::int64_t n,
                                          const LambStep& step, float ratio) {
    lamb_apply_lanes<Lanes512>(param, exp_avg, exp_avg_sq, n, step, ratio);
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
  lamb_moments_bf16_any<Kernels, Avx512Words>(param, bf16, grad, grad_dtype, write_grad, exp_avg,
                                              exp_avg_sq, n, step, param_sq, update_sq);
}

void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_bf16_any<Kernels, Avx512Words>(param, bf16, exp_avg, exp_avg_sq, n, step, ratio);
}

}  // namespace ampfuse::kernels::cpu::avx512

#endif
