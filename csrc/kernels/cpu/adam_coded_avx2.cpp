// The CPU Adam step with 8-bit block-coded moments fused into one pass per block, for processors
// with AVX2, FMA and F16C (adam_coded_kernels.cpp picks it; elsewhere the step decodes a block
// into fp32, runs adam_span on it and codes it again).
//
// The step runs the very 8-lane loops of the fp32-moment kernels (adam_lanes, adam_bf16_lanes)
// with a moment holder, BlockMoments, that decodes eight elements of each moment into lanes as
// the loop loads them, and takes the updated lanes as it stores them: the first moment and the
// update's own sqrt(v) (the second moment's coded value) go to a block buffer while their
// absmax is kept in a register. The block is then coded from the buffers. Against decode ->
// adam_span -> encode this leaves out one pass over the block per moment, the fp32 moment
// stores and loads between them, and the second square root of v. The codes are
// coded_lanes_avx2.h's, so the result is the same bits as the unfused step (the Python tests
// compare the two on this processor, and both with the plain-torch reference).
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "bf16_variants.h"
#include "coded_lanes_avx2.h"
#include "coded_moments.h"

// The loops' own target. BlockMoments' members carry it too, without always_inline: the
// loops (adam_lanes) that call them are target-free templates, inlined into adam_blocks, and GCC
// refuses to force a target-specific function into a target-free one (as F16cLanes, they
// inline once the loop sits in an AVX2 function).
#define AMPFUSE_AVX2_FMA_F16C __attribute__((target("avx2,fma,f16c")))

namespace ampfuse::kernels::cpu::avx2_fma {
namespace {

AMPFUSE_AVX2_FMA __m256 to_m256(Lanes8 x) { return reinterpret_cast<__m256>(x.v); }
AMPFUSE_AVX2_FMA Lanes8 to_lanes(__m256 x) { return Lanes8(reinterpret_cast<Float8>(x)); }

// One coded moment of one block: its codes (read in the loop's loads, written by code()), its
// scale, and the buffer and running absmax of the values it will be coded from.
template <StateCode kCode, bool kSecond>
struct BlockMoment {
  std::uint8_t* codes;
  float* scale;
  __m256 scale8;
  __m256i largest;
  alignas(32) float coded[kStateBlock];  // m, or sqrt(v) / sqrt(max_v)

  AMPFUSE_AVX2_FMA_F16C void start(std::uint8_t* block_codes, float* block_scale) {
    codes = block_codes;
    scale = block_scale;
    scale8 = broadcast(*block_scale);
    largest = _mm256_setzero_si256();
  }
  AMPFUSE_AVX2_FMA_F16C Lanes8 load(std::int64_t i) const {
    return to_lanes(decode8<kCode, kSecond>(codes + i, scale8));
  }
  AMPFUSE_AVX2_FMA_F16C void keep(std::int64_t i, __m256 value) {
    _mm256_store_ps(coded + i, value);
    largest = _mm256_max_epu32(largest, magnitude_bits(value));
  }
  // Elements [i, n) decoded into the buffer, for the scalar loop to step in place.
  float* decode_tail(std::int64_t i, std::int64_t n) {
    for (std::int64_t j = i; j < n; ++j) coded[j] = decode_moment<kCode, kSecond>(codes[j], *scale);
    return coded + i;
  }
  // After the scalar loop: its second-moment values become their coded values, the roots.
  void root_tail(std::int64_t i, std::int64_t n) {
    for (std::int64_t j = i; j < n; ++j) coded[j] = coded_value<kSecond>(coded[j]);
  }
  AMPFUSE_AVX2_FMA_F16C void code(int whole, int n) {
    const float absmax = finish_absmax(largest, coded, whole, n);
    *scale = absmax;
    code_block<kCode, kSecond>(coded, n, absmax, codes);
  }
};

// The moments of one block for adam_lanes / adam_bf16_lanes (see FloatMoments).
template <StateCode kCode, bool kAmsgrad>
struct BlockMoments {
  BlockMoment<kCode, false> exp_avg;
  BlockMoment<kCode, true> exp_avg_sq;
  BlockMoment<kCode, true> max_exp_avg_sq;  // started and coded only when kAmsgrad

  template <template <typename> class Lanes, bool kAmsgradLoop>
  AMPFUSE_AVX2_FMA_F16C void load(std::int64_t i, Lanes8& m, Lanes8& v, Lanes8& max_v) const {
    m = exp_avg.load(i);
    v = exp_avg_sq.load(i);
    if (kAmsgrad) max_v = max_exp_avg_sq.load(i);
  }
  // `root` is sqrt(v), or sqrt(max_v) under AMSGrad, when v's root is formed here.
  template <template <typename> class Lanes, bool kAmsgradLoop>
  AMPFUSE_AVX2_FMA_F16C void store(std::int64_t i, Lanes8 m, Lanes8 v, Lanes8 /*max_v*/,
                                   Lanes8 root) {
    exp_avg.keep(i, to_m256(m));
    if (kAmsgrad) {
      exp_avg_sq.keep(i, _mm256_sqrt_ps(to_m256(v)));
      max_exp_avg_sq.keep(i, to_m256(root));
    } else {
      exp_avg_sq.keep(i, to_m256(root));
    }
  }
  FloatMoments scalar_tail(std::int64_t i, std::int64_t n) {
    return {exp_avg.decode_tail(i, n), exp_avg_sq.decode_tail(i, n),
            kAmsgrad ? max_exp_avg_sq.decode_tail(i, n) : nullptr};
  }
  void after_scalar_tail(std::int64_t i, std::int64_t n) {
    exp_avg_sq.root_tail(i, n);
    if (kAmsgrad) max_exp_avg_sq.root_tail(i, n);
  }

  AMPFUSE_AVX2_FMA_F16C void start(const CodedMoments& c, std::int64_t first) {
    const std::int64_t block = first / kStateBlock;
    exp_avg.start(c.exp_avg + first, c.exp_avg_scales + block);
    exp_avg_sq.start(c.exp_avg_sq + first, c.exp_avg_sq_scales + block);
    if (kAmsgrad) max_exp_avg_sq.start(c.max_exp_avg_sq + first, c.max_exp_avg_sq_scales + block);
  }
  AMPFUSE_AVX2_FMA_F16C void code(int n) {
    const int whole = n - n % 8;
    exp_avg.code(whole, n);
    exp_avg_sq.code(whole, n);
    if (kAmsgrad) max_exp_avg_sq.code(whole, n);
  }
};

// Params with fp32 masters or none (fp32, fp16 or bf16), block by block.
template <StateCode kCode, bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param,
          typename Grad>
AMPFUSE_AVX2_FMA_F16C void adam_blocks(Param* param, Grad* grad, const CodedMoments& c,
                                       float* master, std::int64_t n, const AdamStep& step) {
  BlockMoments<kCode, kAmsgrad> moments;
  for (std::int64_t first = 0; first < n; first += kStateBlock) {
    const int len = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - first));
    moments.start(c, first);
    adam_lanes<avx2::F16cLanes, kMaster, kWriteGrad, kAmsgrad>(
        param + first, grad + first, moments, kMaster ? master + first : nullptr, len, step);
    moments.code(len);
  }
}

// bf16 params in a master-free mode (bf16_modes.h), block by block; each block keys stochastic
// rounding by its elements' true indices, as one call over the span would.
template <StateCode kCode, MasterMode kMode, bool kWriteGrad, bool kAmsgrad, typename Grad>
AMPFUSE_AVX2_FMA_F16C void adam_bf16_blocks(std::uint16_t* param, const Bf16Span& bf16, Grad* grad,
                                            const CodedMoments& c, std::int64_t n,
                                            const AdamStep& step) {
  BlockMoments<kCode, kAmsgrad> moments;
  for (std::int64_t first = 0; first < n; first += kStateBlock) {
    const int len = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - first));
    const std::int64_t index = bf16.first_index + first;
    moments.start(c, first);
    adam_bf16_lanes<avx2::F16cLanes, Avx2Words, kMode, kWriteGrad, kAmsgrad>(
        param + first, bf16.extra != nullptr ? bf16.extra + first : nullptr, grad + first, moments,
        len, chunk_key(bf16.key, index), static_cast<std::uint32_t>(index), step);
    moments.code(len);
  }
}

template <StateCode kCode>
void adam_coded(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                const CodedMoments& c, float* master, const Bf16Span* bf16, std::int64_t n,
                const AdamStep& step) {
  if (bf16 != nullptr) {
    with_bf16_span_types(*bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
      with_flag(step.amsgrad, [&](auto amsgrad) {
        adam_bf16_blocks<kCode, decltype(mode)::value, write, amsgrad>(
            static_cast<std::uint16_t*>(param), *bf16, g, c, n, step);
      });
    });
    return;
  }
  with_span_types(param, param_dtype, grad, grad_dtype, master != nullptr, write_grad,
                  [&](auto* p, auto* g, auto has_master, auto write) {
                    with_flag(step.amsgrad, [&](auto amsgrad) {
                      adam_blocks<kCode, has_master, write, amsgrad>(p, g, c, master, n, step);
                    });
                  });
}

}  // namespace

void adam_coded_span(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                     const CodedMoments& moments, float* master, const Bf16Span* bf16,
                     std::int64_t n, const AdamStep& step) {
  if (moments.code == StateCode::kFp8) {
    adam_coded<StateCode::kFp8>(param, param_dtype, grad, grad_dtype, write_grad, moments, master,
                                bf16, n, step);
  } else {
    adam_coded<StateCode::kInt8>(param, param_dtype, grad, grad_dtype, write_grad, moments, master,
                                 bf16, n, step);
  }
}

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
