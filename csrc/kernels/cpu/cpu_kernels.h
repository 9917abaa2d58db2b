// Torch-free CPU kernels. Each works on one contiguous span of elements; the op
// layer splits lists into spans and runs them on torch's thread pool.
#pragma once

#include <cstdint>

#include "../adagrad_math.h"
#include "../bf16_modes.h"
#include "../dtype.h"
#include "../lamb_math.h"
#include "../nonfinite_kind.h"
#include "../novograd_math.h"
#include "../optimizer_math.h"
#include "../state_codes.h"

namespace ampfuse::kernels::cpu {

// data[i] *= inv_scale in fp32 math. Returns the kinds of non-finite input elements
// (kHeldInf | kHeldNan bits of nonfinite_kind.h; 0 when every element is finite).
std::uint32_t unscale_span(void* data, DType dtype, std::int64_t n, float inv_scale);

// dst[i] = src[i] * scale in fp32 math, cast to dst's type. Returns the kinds of non-finite
// src elements, as unscale_span. src and dst may be the same span (same dtype).
std::uint32_t scale_span(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                         std::int64_t n, float scale);

// True if any element is inf or nan. Reads the span only.
bool nonfinite_span(const void* data, DType dtype, std::int64_t n);

// The kinds of non-finite elements in the span (kHeldInf | kHeldNan; 0 when all finite).
// Reads the span only; the op layer calls it only for spans nonfinite_span flagged, so a
// clean step never pays for telling inf from nan.
std::uint32_t nonfinite_kinds_span(const void* data, DType dtype, std::int64_t n);

// Sum of squares of the span, accumulated in fp32 lanes and returned as double.
double sum_of_squares_span(const void* data, DType dtype, std::int64_t n);

// One Adam/AdamW step over a span. exp_avg, exp_avg_sq, max_exp_avg_sq (null
// unless amsgrad) and master (null when the param is updated directly) are fp32.
// With a master, the update is applied to it and param receives it rounded. The grad
// is divided by step.grad_scale; with write_grad the result is stored back into it.
void adam_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
               float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
               std::int64_t n, const AdamStep& step);

// One SGD step over a span; momentum_buffer (fp32) is null when momentum is 0. Grads as in
// adam_span.
void sgd_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
              float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step);

// One Adagrad step over a span (adagrad_math.h): `sum` (fp32) holds the running sum of squared
// grads; master and the grad as in adam_span.
void adagrad_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                  float* sum, float* master, std::int64_t n, const AdagradStep& step);

// LAMB's first pass over a span (lamb_math.h): divides the grad by step.grad_scale (stored back
// so with write_grad), updates the fp32 moments, and adds the squares of the fp32 param (the
// master when there is one; master is null otherwise) and of the update to *param_sq and
// *update_sq. The param is only read.
void lamb_moments_span(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                       bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                       std::int64_t n, const LambStep& step, double* param_sq, double* update_sq);

// LAMB's second pass: p -= ratio * update, the update recomputed from the stored moments; with
// a master the master is updated and the param receives it rounded.
void lamb_apply_span(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                     float* master, std::int64_t n, const LambStep& step, float ratio);

// NovoGrad's first pass over a span of grads (novograd_math.h): the reduction of the grads
// divided by grad_scale, their sum of squares (max_norm false) or their largest |g| (true; a
// NaN grad makes it NaN). The grads are only read.
double novograd_norm_span(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                          bool max_norm);

// NovoGrad's second pass: the first moment and the param (the master when there is one,
// which the param then receives rounded), `denom` the tensor's novograd_denominator. The grad
// is divided by step.grad_scale and, with write_grad, stored back so.
void novograd_apply_span(void* param, DType param_dtype, void* grad, DType grad_dtype,
                         bool write_grad, float* exp_avg, float* master, std::int64_t n,
                         const NovoGradStep& step, float denom);

// bf16 params without an fp32 master (master_weights="stochastic", "kahan", "split"):
// `extra` holds the kahan compensations or the split low halves (bf16 bits; null for
// kStochastic), and element i of the span is element first_index + i of a param whose
// stochastic-rounding key is `key`.
struct Bf16Span {
  MasterMode mode;
  std::uint16_t* extra;
  RoundingKey key;
  std::int64_t first_index;
};

// adam_span, sgd_span and adagrad_span for such a param (`param` holds bf16 bits); same grads
// and state.
void adam_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                    bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                    std::int64_t n, const AdamStep& step);
void sgd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step);
void adagrad_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                       bool write_grad, float* sum, std::int64_t n, const AdagradStep& step);

// novograd_apply_span for such a param (NovoGrad's first pass reads only the grads, so it has
// no bf16 variant): the same grads, first moment and denominator.
void novograd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                        bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                        float denom);

// lamb_moments_span and lamb_apply_span for such a param: the first pass reads the value its
// mode holds (param and compensation, or param and low half) and writes only the moments; the
// second writes the param (and its compensation or low half) through its mode.
void lamb_moments_bf16_span(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                            DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                            std::int64_t n, const LambStep& step, double* param_sq,
                            double* update_sq);
void lamb_apply_bf16_span(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                          const float* exp_avg_sq, std::int64_t n, const LambStep& step,
                          float ratio);

// Adam's moments as 8-bit block codes (state_codes.h) over one span of a param: the span
// starts on a block boundary, so it holds whole blocks (its last may be short), and each
// pointer is at the span's first element (codes) or first block (scales). The max_exp_avg_sq
// pair is null unless step.amsgrad.
struct CodedMoments {
  StateCode code;
  std::uint8_t* exp_avg;
  float* exp_avg_scales;
  std::uint8_t* exp_avg_sq;
  float* exp_avg_sq_scales;
  std::uint8_t* max_exp_avg_sq;
  float* max_exp_avg_sq_scales;
};

// adam_span (bf16 == null) or adam_bf16_span (bf16 params without masters) over a span whose
// moments are coded: per block, decode, the fp32-state step, encode. Equal bit for bit to
// decoding the whole moment, running adam_span on it and coding it again.
void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step);

// The two implementations adam_coded_span picks from (adam_coded_kernels.cpp), the same bits:
// decode, the fp32-state span kernel and encode per block; and, for processors with AVX2, FMA
// and F16C (avx2_fma::supported(), coded_moments.h), one fused pass per block.
namespace portable {
void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step);
}  // namespace portable
#if defined(__x86_64__) && defined(__GNUC__)
namespace avx2_fma {
void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step);
}  // namespace avx2_fma
// Sixteen lanes, for processors with AVX-512 (cpu_has_avx512(), lanes_avx512.h;
// adam_coded_avx512.cpp).
namespace avx512 {
void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
