// LAMB's two passes over a CPU span whose moments are 8-bit block codes (state_dtype "int8" /
// "fp8", state_codes.h), as fused_lamb_coded_ (csrc/ops/lamb_coded.cpp) runs them. Both equal,
// bit for bit, decoding the moments, running the fp32 LAMB spans (cpu_kernels.h) on them and
// coding the new moments again.
//
// The second pass reads the new moments at full precision (lamb_math.h forms the update from
// them), so the first pass cannot code them for the second to read. It therefore only forms the
// sums of squares from the decoded moments and writes nothing; the second forms the new moments
// again from the same codes, grads and params (the same arithmetic, so the same bits), steps the
// params with the update they give, codes them and, with write_grad, writes the unscaled grads.
//
// `moments` points at the span's first code and its first block's scale (the span starts on a
// block, kStateBlock); `bf16` is null, or the master-free mode of a bf16 param (then `master` is
// null). The sums are added to *param_sq and *update_sq, formed in the fp32 spans' order.
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../lamb_math.h"
#include "cpu_kernels.h"

namespace ampfuse::kernels::cpu {

void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq);
void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio);

// The implementations those pick from (lamb_coded_kernels.cpp), the same bits: portable::
// decodes into fp32 spans, runs the portable fp32 LAMB spans and codes; avx2_fma:: (where
// avx2_fma::supported(), coded_moments.h) and avx512:: (where cpu_has_avx512(), lanes_avx512.h)
// fuse the decoding and coding into the passes' loops (lamb_coded_lanes.inc).
namespace portable {
void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq);
void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio);
}  // namespace portable
#if defined(__x86_64__) && defined(__GNUC__)
namespace avx2_fma {
void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq);
void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio);
}  // namespace avx2_fma
namespace avx512 {
void lamb_coded_sums_span(const void* param, DType param_dtype, const Bf16Span* bf16,
                          const float* master, const void* grad, DType grad_dtype,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          double* param_sq, double* update_sq);
void lamb_coded_step_span(void* param, DType param_dtype, const Bf16Span* bf16, float* master,
                          void* grad, DType grad_dtype, bool write_grad,
                          const CodedMoments& moments, std::int64_t n, const LambStep& step,
                          float ratio);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
