// CPU Adam/AdamW with 8-bit block-coded moments (state_dtype "int8" / "fp8"). portable:: decodes
// each block of kStateBlock elements into fp32 buffers on the stack, steps it with the very span
// kernels that step fp32 moments (adam_span, adam_bf16_span), and codes it again. Running the
// fp32-state kernels on the decoded block is what makes the result equal, bit for bit, to
// dequantize -> fused_adam_ -> quantize (python/ampfuse/optimizers/_state_codes.py). Where the
// processor has AVX2, FMA and F16C, adam_coded_span runs avx2_fma:: instead: the same loops
// with decoding and coding fused into them (adam_coded_avx2.cpp), the same bits
// (tests/cpp/test_coded_adam.cpp compares the two).
#include <algorithm>

#include "coded_moments.h"
#include "cpu_kernels.h"
#include "lanes_avx512.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

// Pointer to element `i` of a span of `dtype` elements.
void* advance(void* data, DType dtype, std::int64_t i) {
  return static_cast<char*>(data) + i * element_size(dtype);
}

template <StateCode kCode>
void adam_coded_blocks(void* param, DType param_dtype, void* grad, DType grad_dtype,
                       bool write_grad, const CodedMoments& moments, float* master,
                       const Bf16Span* bf16, std::int64_t n, const AdamStep& step) {
  // One block's decoded moments; a few KB of stack, reused by every block of the span.
  alignas(64) float exp_avg[kStateBlock];
  alignas(64) float exp_avg_sq[kStateBlock];
  alignas(64) float max_exp_avg_sq[kStateBlock];
  float* max_buffer = moments.max_exp_avg_sq != nullptr ? max_exp_avg_sq : nullptr;
  for (std::int64_t first = 0; first < n; first += kStateBlock) {
    const int len = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - first));
    // coded_moments.h's portable loops: decode_block's and encode_block's bits. This step runs
    // only where the fused ones cannot, and the tests compare those with it: it never borrows
    // their vector codecs.
    portable::decode_moment_span(moments.exp_avg, moments.exp_avg_scales, first, len, kCode, false,
                                 exp_avg);
    portable::decode_moment_span(moments.exp_avg_sq, moments.exp_avg_sq_scales, first, len, kCode,
                                 true, exp_avg_sq);
    if (max_buffer != nullptr) {
      portable::decode_moment_span(moments.max_exp_avg_sq, moments.max_exp_avg_sq_scales, first,
                                   len, kCode, true, max_buffer);
    }
    void* block_grad = advance(grad, grad_dtype, first);
    if (bf16 != nullptr) {
      // The block's elements keep their true indices: stochastic rounding is keyed by them.
      const Bf16Span block_bf16{bf16->mode, bf16->extra != nullptr ? bf16->extra + first : nullptr,
                                bf16->key, bf16->first_index + first};
      adam_bf16_span(static_cast<std::uint16_t*>(param) + first, block_bf16, block_grad, grad_dtype,
                     write_grad, exp_avg, exp_avg_sq, max_buffer, len, step);
    } else {
      adam_span(advance(param, param_dtype, first), param_dtype, block_grad, grad_dtype, write_grad,
                exp_avg, exp_avg_sq, max_buffer, master != nullptr ? master + first : nullptr, len,
                step);
    }
    portable::encode_moment_span(exp_avg, first, len, kCode, false, moments.exp_avg,
                                 moments.exp_avg_scales);
    portable::encode_moment_span(exp_avg_sq, first, len, kCode, true, moments.exp_avg_sq,
                                 moments.exp_avg_sq_scales);
    if (max_buffer != nullptr) {
      portable::encode_moment_span(max_buffer, first, len, kCode, true, moments.max_exp_avg_sq,
                                   moments.max_exp_avg_sq_scales);
    }
  }
}

}  // namespace

namespace portable {

void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step) {
  if (moments.code == StateCode::kFp8) {
    adam_coded_blocks<StateCode::kFp8>(param, param_dtype, grad, grad_dtype, write_grad, moments,
                                       master, bf16, n, step);
  } else {
    adam_coded_blocks<StateCode::kInt8>(param, param_dtype, grad, grad_dtype, write_grad, moments,
                                        master, bf16, n, step);
  }
}

}  // namespace portable

void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step) {
#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
  if (cpu_has_avx512()) {
    avx512::adam_coded_span(param, param_dtype, grad, grad_dtype, write_grad, moments, master, bf16,
                            n, step);
    return;
  }
  if (avx2_fma::supported()) {
    avx2_fma::adam_coded_span(param, param_dtype, grad, grad_dtype, write_grad, moments, master,
                              bf16, n, step);
    return;
  }
#endif
  portable::adam_coded_span(param, param_dtype, grad, grad_dtype, write_grad, moments, master, bf16,
                            n, step);
}

}  // namespace ampfuse::kernels::cpu
