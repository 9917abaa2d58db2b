// The AVX2+F16C Adam and SGD span kernels (see optimizer_variants.h). fp16 and bf16 arrays
// are widened to fp32 a block at a time with the vector conversions of vec_avx2.h, the
// shared element loop runs on the fp32 block (inlined here, so it is vectorized for AVX2),
// and the results are narrowed back. The vector conversions give the same bits as
// half_convert.h's, and the loop is the portable one, so results match portable:: exactly.
// The last n % 8 elements run the loop on the arrays themselves, converting in software.
#include "optimizer_variants.h"

#ifdef AMPFUSE_HAVE_AVX2_PATH

#include <algorithm>

namespace ampfuse::kernels::cpu::avx2 {
namespace {

// Elements per block: the staged fp32 copies (4 KB at most) stay in L1.
constexpr std::int64_t kBlock = 512;

// An fp32 view of one block of a Storage array. fp32 arrays are used in place.
template <typename Storage>
struct Staged {
  alignas(32) float block[kBlock];

  // The block as fp32; n is a multiple of 8, at most kBlock.
  AMPFUSE_AVX2 float* load(const Storage* data, std::int64_t n) {
    for (std::int64_t i = 0; i < n; i += 8) _mm256_store_ps(block + i, Vec8<Storage>::load(data + i));
    return block;
  }
  // Space for a block that is only written (a param updated from its master).
  float* scratch(Storage*) { return block; }
  AMPFUSE_AVX2 void store(Storage* data, std::int64_t n) const {
    for (std::int64_t i = 0; i < n; i += 8) Vec8<Storage>::store(data + i, _mm256_load_ps(block + i));
  }
};

template <>
struct Staged<float> {
  float* data = nullptr;
  float* load(float* d, std::int64_t) { return data = d; }
  float* scratch(float* d) { return data = d; }
  void store(float*, std::int64_t) const {}
};

// p + offset for the arrays that may be null (unused by the options in force).
inline float* at(float* p, std::int64_t offset) { return p == nullptr ? nullptr : p + offset; }

// Runs loop(param, grad, offset, count) over n elements: whole blocks of multiples of 8 on
// staged fp32 copies, then the tail on the arrays themselves.
template <bool kMaster, bool kWriteGrad, typename Param, typename Grad, typename Loop>
AMPFUSE_AVX2 inline void staged_blocks(Param* param, Grad* grad, std::int64_t n, const Loop& loop) {
  Staged<Param> staged_param;
  Staged<Grad> staged_grad;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t start = 0; start < whole; start += kBlock) {
    const std::int64_t count = std::min(kBlock, whole - start);
    float* g = staged_grad.load(grad + start, count);
    float* p = kMaster ? staged_param.scratch(param + start)
                       : staged_param.load(param + start, count);
    loop(p, g, start, count);
    if (kWriteGrad) staged_grad.store(grad + start, count);
    staged_param.store(param + start, count);
  }
  loop(param + whole, grad + whole, whole, n - whole);
}

// The element loops over one block (offset, count) of the span, for staged_blocks. Functors
// rather than lambdas: a lambda would not take the target attribute of the function it is in.
template <bool kMaster, bool kWriteGrad, bool kAmsgrad>
struct AdamBlock {
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  float* master;
  const AdamStep& step;

  template <typename Param, typename Grad>
  AMPFUSE_AVX2 void operator()(Param* p, Grad* g, std::int64_t offset, std::int64_t count) const {
    adam_loop<kMaster, kWriteGrad, kAmsgrad>(p, g, exp_avg + offset, exp_avg_sq + offset,
                                             at(max_exp_avg_sq, offset), at(master, offset),
                                             count, step);
  }
};

template <bool kMaster, bool kWriteGrad, bool kMomentum>
struct SgdBlock {
  float* momentum_buffer;
  float* master;
  const SgdStep& step;

  template <typename Param, typename Grad>
  AMPFUSE_AVX2 void operator()(Param* p, Grad* g, std::int64_t offset, std::int64_t count) const {
    sgd_loop<kMaster, kWriteGrad, kMomentum>(p, g, at(momentum_buffer, offset),
                                             at(master, offset), count, step);
  }
};

struct Kernels {
  template <bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param, typename Grad>
  AMPFUSE_AVX2 static void adam(Param* param, Grad* grad, float* exp_avg, float* exp_avg_sq,
                                float* max_exp_avg_sq, float* master, std::int64_t n,
                                const AdamStep& step) {
    const AdamBlock<kMaster, kWriteGrad, kAmsgrad> block{exp_avg, exp_avg_sq, max_exp_avg_sq,
                                                         master, step};
    staged_blocks<kMaster, kWriteGrad>(param, grad, n, block);
  }

  template <bool kMaster, bool kWriteGrad, bool kMomentum, typename Param, typename Grad>
  AMPFUSE_AVX2 static void sgd(Param* param, Grad* grad, float* momentum_buffer, float* master,
                               std::int64_t n, const SgdStep& step) {
    const SgdBlock<kMaster, kWriteGrad, kMomentum> block{momentum_buffer, master, step};
    staged_blocks<kMaster, kWriteGrad>(param, grad, n, block);
  }
};

}  // namespace

void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
          std::int64_t n, const AdamStep& step) {
  adam_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                    max_exp_avg_sq, master, n, step);
}

void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step) {
  sgd_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, momentum_buffer, master, n,
                   step);
}

}  // namespace ampfuse::kernels::cpu::avx2

#endif
