// LAMB over 8-bit coded moments (lamb_coded.h): the portable passes, which decode each moment into
// an fp32 span, run the portable fp32 LAMB spans on it and code it again, and the choice between
// them and the fused vector passes (lamb_coded_avx2.cpp, lamb_coded_avx512.cpp).
#include <vector>

#include "coded_moments.h"
#include "lamb_coded.h"
#include "lamb_variants.h"
#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu {
namespace portable {
namespace {

// A thread's fp32 moments of one span: made once per thread, grown to the largest span.
struct DecodedMoments {
  std::vector<float> exp_avg, exp_avg_sq;
};

DecodedMoments& decoded(const CodedMoments& c, std::int64_t n) {
  thread_local DecodedMoments moments;
  moments.exp_avg.resize(static_cast<std::size_t>(n));
  moments.exp_avg_sq.resize(static_cast<std::size_t>(n));
  decode_moment_span(c.exp_avg, c.exp_avg_scales, 0, n, c.code, false, moments.exp_avg.data());
  decode_moment_span(c.exp_avg_sq, c.exp_avg_sq_scales, 0, n, c.code, true,
                     moments.exp_avg_sq.data());
  return moments;
}

// The fp32 first pass on the decoded moments (updated in place).
void first_pass(const void* param, DType param_dtype, const Bf16Span* bf16, const float* master,
                void* grad, DType grad_dtype, bool write_grad, DecodedMoments& m, std::int64_t n,
                const LambStep& step, double* param_sq, double* update_sq) {
  if (bf16 != nullptr) {
    lamb_moments_bf16(static_cast<const std::uint16_t*>(param), *bf16, grad, grad_dtype, write_grad,
                      m.exp_avg.data(), m.exp_avg_sq.data(), n, step, param_sq, update_sq);
    return;
  }
  lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, m.exp_avg.data(),
               m.exp_avg_sq.data(), master, n, step, param_sq, update_sq);
}

}  // namespace

void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq) {
  // Nothing is written: write_grad is false, and the decoded moments are dropped.
  first_pass(param, param_dtype, bf16, master, const_cast<void*>(grad), grad_dtype, false,
             decoded(moments, n), n, step, param_sq, update_sq);
}

void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio) {
  DecodedMoments& m = decoded(moments, n);
  double unused_param_sq = 0.0, unused_update_sq = 0.0;
  first_pass(param, param_dtype, bf16, master, grad, grad_dtype, write_grad, m, n, step,
             &unused_param_sq, &unused_update_sq);
  if (bf16 != nullptr) {
    lamb_apply_bf16(static_cast<std::uint16_t*>(param), *bf16, m.exp_avg.data(),
                    m.exp_avg_sq.data(), n, step, ratio);
  } else {
    lamb_apply(param, param_dtype, m.exp_avg.data(), m.exp_avg_sq.data(), master, n, step, ratio);
  }
  encode_moment_span(m.exp_avg.data(), 0, n, moments.code, false, moments.exp_avg,
                     moments.exp_avg_scales);
  encode_moment_span(m.exp_avg_sq.data(), 0, n, moments.code, true, moments.exp_avg_sq,
                     moments.exp_avg_sq_scales);
}

}  // namespace portable

void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx512()) {
    avx512::lamb_coded_sums_span(param, param_dtype, bf16, master, grad, grad_dtype, moments, n,
                                 step, param_sq, update_sq);
    return;
  }
  if (avx2_fma::supported()) {
    avx2_fma::lamb_coded_sums_span(param, param_dtype, bf16, master, grad, grad_dtype, moments, n,
                                   step, param_sq, update_sq);
    return;
  }
#endif
  portable::lamb_coded_sums_span(param, param_dtype, bf16, master, grad, grad_dtype, moments, n,
                                 step, param_sq, update_sq);
}

void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx512()) {
    avx512::lamb_coded_step_span(param, param_dtype, bf16, master, grad, grad_dtype, write_grad,
                                 moments, n, step, ratio);
    return;
  }
  if (avx2_fma::supported()) {
    avx2_fma::lamb_coded_step_span(param, param_dtype, bf16, master, grad, grad_dtype, write_grad,
                                   moments, n, step, ratio);
    return;
  }
#endif
  portable::lamb_coded_step_span(param, param_dtype, bf16, master, grad, grad_dtype, write_grad,
                                 moments, n, step, ratio);
}

}  // namespace ampfuse::kernels::cpu
