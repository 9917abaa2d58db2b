// The implementations behind the LAMB spans (cpu_kernels.h): the loops of lamb_lanes.h eight
// lanes wide with fp16/bf16 converted in software (portable::) or with F16C (avx2::), both in
// lamb_kernels.cpp, and sixteen lanes wide with AVX-512 (avx512::, lamb_kernels_avx512.cpp). The
// public spans pick one per call; the tests run all and require the same bits, as they do for
// NovoGrad (novograd_variants.h), Adam and SGD (optimizer_variants.h).
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../lamb_math.h"
#include "cpu_kernels.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Same signatures as lamb_moments_span, lamb_apply_span, lamb_moments_bf16_span and
// lamb_apply_bf16_span (cpu_kernels.h).
namespace portable {
void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio);
void lamb_moments_bf16(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                       DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio);
void lamb_moments_bf16(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                       DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio);
}  // namespace avx2

// Sixteen lanes (lamb_kernels_avx512.cpp), the same bits; call only where cpu_has_avx512()
// (lanes_avx512.h).
namespace avx512 {
void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio);
void lamb_moments_bf16(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                       DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply_bf16(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                     const float* exp_avg_sq, std::int64_t n, const LambStep& step, float ratio);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
