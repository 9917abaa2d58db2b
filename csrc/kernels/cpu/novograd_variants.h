// The two implementations behind novograd_norm_span and novograd_apply_span (cpu_kernels.h),
// both in novograd_kernels.cpp: the same 8-lane loops, with fp16/bf16 converted in software
// (portable::) or with F16C (avx2::). The public spans pick one per call; the tests run both and
// require the same bits, as they do for Adam and SGD (optimizer_variants.h). The max reduction
// is one scalar loop that both call.
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../novograd_math.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Same signatures as novograd_norm_span and novograd_apply_span (cpu_kernels.h).
namespace portable {
double novograd_norm(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                     bool max_norm);
void novograd_apply(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                    float* exp_avg, float* master, std::int64_t n, const NovoGradStep& step,
                    float denom);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
double novograd_norm(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                     bool max_norm);
void novograd_apply(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                    float* exp_avg, float* master, std::int64_t n, const NovoGradStep& step,
                    float denom);
}  // namespace avx2
#endif

}  // namespace ampfuse::kernels::cpu
