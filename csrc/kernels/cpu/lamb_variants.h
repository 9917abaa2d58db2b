// The two implementations behind lamb_moments_span and lamb_apply_span (cpu_kernels.h), both in
// lamb_kernels.cpp: the same 8-lane loops, with fp16/bf16 converted in software (portable::) or
// with F16C (avx2::). The public spans pick one per call; the tests run both and require the
// same bits, as they do for NovoGrad (novograd_variants.h), Adam and SGD (optimizer_variants.h).
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../lamb_math.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Same signatures as lamb_moments_span and lamb_apply_span (cpu_kernels.h).
namespace portable {
void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);
void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio);
}  // namespace avx2
#endif

}  // namespace ampfuse::kernels::cpu
