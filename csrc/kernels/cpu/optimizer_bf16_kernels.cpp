// CPU Adam/AdamW, SGD, Adagrad and NovoGrad (second pass) span kernels for bf16 params without
// an fp32 master (master_weights="stochastic", "kahan" and "split"; bf16_modes.h): the 8-lane
// loops of bf16_variants.h in their two implementations, and the choice between them. The update
// math is the same optimizer_math.h / adagrad_math.h / novograd_math.h code as the fp32-master
// kernels', and a per-step option is a branch per eight elements (see choose()).
//
// (Until 2026-11-28 these were scalar loops that GCC vectorized: every option was then computed
// and masked, and with the rounded split the Adam loop took 1.4x master_weights=True's time.)
#include "bf16_variants.h"
#include "cpu_kernels.h"
#include "lanes_avx512.h"

namespace ampfuse::kernels::cpu {
namespace {

// Calls Kernels::template <loop><mode, write, flag>(typed grad) for one span's runtime choices.
template <typename F>
void with_bf16_loop_types(const Bf16Span& bf16, void* grad, DType grad_dtype, bool write_grad,
                          bool flag, F&& f) {
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    with_flag(flag, [&](auto on) { f(mode, g, write, on); });
  });
}

// The entry points of one implementation, whose typed loops are Kernels' static member
// templates adam, sgd, adagrad and novograd<kMode, kWriteGrad, kFlag>(...).
template <typename Kernels>
struct Bf16Spans {
  static void adam(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                   std::int64_t n, const AdamStep& step) {
    with_bf16_loop_types(bf16, grad, grad_dtype, write_grad, step.amsgrad,
                         [&](auto mode, auto* g, auto write, auto amsgrad) {
                           Kernels::template adam<decltype(mode)::value, write, amsgrad>(
                               param, bf16.extra, g, exp_avg, exp_avg_sq, max_exp_avg_sq, n,
                               chunk_key(bf16.key, bf16.first_index),
                               static_cast<std::uint32_t>(bf16.first_index), step);
                         });
  }

  static void sgd(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                  bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step) {
    with_bf16_loop_types(bf16, grad, grad_dtype, write_grad, momentum_buffer != nullptr,
                         [&](auto mode, auto* g, auto write, auto has_momentum) {
                           Kernels::template sgd<decltype(mode)::value, write, has_momentum>(
                               param, bf16.extra, g, momentum_buffer, n,
                               chunk_key(bf16.key, bf16.first_index),
                               static_cast<std::uint32_t>(bf16.first_index), step);
                         });
  }

  static void adagrad(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                      bool write_grad, float* sum, std::int64_t n, const AdagradStep& step) {
    with_bf16_loop_types(bf16, grad, grad_dtype, write_grad, step.decoupled,
                         [&](auto mode, auto* g, auto write, auto decoupled) {
                           Kernels::template adagrad<decltype(mode)::value, write, decoupled>(
                               param, bf16.extra, g, sum, n, chunk_key(bf16.key, bf16.first_index),
                               static_cast<std::uint32_t>(bf16.first_index), step);
                         });
  }

  static void novograd(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                       bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                       float denom) {
    with_bf16_loop_types(bf16, grad, grad_dtype, write_grad, step.reg_inside_moment,
                         [&](auto mode, auto* g, auto write, auto inside) {
                           Kernels::template novograd<decltype(mode)::value, write, inside>(
                               param, bf16.extra, g, exp_avg, n,
                               chunk_key(bf16.key, bf16.first_index),
                               static_cast<std::uint32_t>(bf16.first_index), step, denom);
                         });
  }
};

}  // namespace

namespace portable {
namespace {

// The loops with software conversions, cloned for AVX2 and the baseline.
struct Kernels {
  template <MasterMode kMode, bool kWriteGrad, bool kAmsgrad, typename Grad>
  AMPFUSE_CPU_CLONES static void adam(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                      float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                                      std::int64_t n, RoundingKey key, std::uint32_t first_lo,
                                      AdamStep step) {
    adam_bf16_lanes<PortableLanes, PortableWords, kMode, kWriteGrad, kAmsgrad>(
        param, extra, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kMomentum, typename Grad>
  AMPFUSE_CPU_CLONES static void sgd(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                     float* momentum_buffer, std::int64_t n, RoundingKey key,
                                     std::uint32_t first_lo, SgdStep step) {
    sgd_bf16_lanes<PortableLanes, PortableWords, kMode, kWriteGrad, kMomentum>(
        param, extra, grad, momentum_buffer, n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kDecoupled, typename Grad>
  AMPFUSE_CPU_CLONES static void adagrad(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                         float* sum, std::int64_t n, RoundingKey key,
                                         std::uint32_t first_lo, AdagradStep step) {
    adagrad_bf16_lanes<PortableLanes, PortableWords, kMode, kWriteGrad, kDecoupled>(
        param, extra, grad, sum, n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kRegInsideMoment, typename Grad>
  AMPFUSE_CPU_CLONES static void novograd(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                          float* exp_avg, std::int64_t n, RoundingKey key,
                                          std::uint32_t first_lo, NovoGradStep step, float denom) {
    novograd_bf16_lanes<PortableLanes, PortableWords, kMode, kWriteGrad, kRegInsideMoment>(
        param, extra, grad, exp_avg, n, key, first_lo, step, denom);
  }
};

}  // namespace

void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step) {
  Bf16Spans<Kernels>::adam(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                           max_exp_avg_sq, n, step);
}

void sgd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
              bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step) {
  Bf16Spans<Kernels>::sgd(param, bf16, grad, grad_dtype, write_grad, momentum_buffer, n, step);
}

void adagrad_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                  bool write_grad, float* sum, std::int64_t n, const AdagradStep& step) {
  Bf16Spans<Kernels>::adagrad(param, bf16, grad, grad_dtype, write_grad, sum, n, step);
}

void novograd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                   float denom) {
  Bf16Spans<Kernels>::novograd(param, bf16, grad, grad_dtype, write_grad, exp_avg, n, step, denom);
}

}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace avx2 {
namespace {

// The loops with F16C grads and AVX2 word moves; run only where cpu_has_avx2_f16c().
struct Kernels {
  template <MasterMode kMode, bool kWriteGrad, bool kAmsgrad, typename Grad>
  AMPFUSE_AVX2 static void adam(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                                std::int64_t n, RoundingKey key, std::uint32_t first_lo,
                                AdamStep step) {
    adam_bf16_lanes<F16cLanes, Avx2Words, kMode, kWriteGrad, kAmsgrad>(
        param, extra, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kMomentum, typename Grad>
  AMPFUSE_AVX2 static void sgd(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                               float* momentum_buffer, std::int64_t n, RoundingKey key,
                               std::uint32_t first_lo, SgdStep step) {
    sgd_bf16_lanes<F16cLanes, Avx2Words, kMode, kWriteGrad, kMomentum>(
        param, extra, grad, momentum_buffer, n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kDecoupled, typename Grad>
  AMPFUSE_AVX2 static void adagrad(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                   float* sum, std::int64_t n, RoundingKey key,
                                   std::uint32_t first_lo, AdagradStep step) {
    adagrad_bf16_lanes<F16cLanes, Avx2Words, kMode, kWriteGrad, kDecoupled>(param, extra, grad, sum,
                                                                            n, key, first_lo, step);
  }

  template <MasterMode kMode, bool kWriteGrad, bool kRegInsideMoment, typename Grad>
  AMPFUSE_AVX2 static void novograd(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                    float* exp_avg, std::int64_t n, RoundingKey key,
                                    std::uint32_t first_lo, NovoGradStep step, float denom) {
    novograd_bf16_lanes<F16cLanes, Avx2Words, kMode, kWriteGrad, kRegInsideMoment>(
        param, extra, grad, exp_avg, n, key, first_lo, step, denom);
  }
};

}  // namespace

void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step) {
  Bf16Spans<Kernels>::adam(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                           max_exp_avg_sq, n, step);
}

void sgd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
              bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step) {
  Bf16Spans<Kernels>::sgd(param, bf16, grad, grad_dtype, write_grad, momentum_buffer, n, step);
}

void adagrad_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                  bool write_grad, float* sum, std::int64_t n, const AdagradStep& step) {
  Bf16Spans<Kernels>::adagrad(param, bf16, grad, grad_dtype, write_grad, sum, n, step);
}

void novograd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                   float denom) {
  Bf16Spans<Kernels>::novograd(param, bf16, grad, grad_dtype, write_grad, exp_avg, n, step, denom);
}

}  // namespace avx2

namespace avx512 {
namespace {

// Adam's loop at sixteen lanes (lanes_avx512.h); run only where cpu_has_avx512().
struct Kernels {
  template <MasterMode kMode, bool kWriteGrad, bool kAmsgrad, typename Grad>
  AMPFUSE_AVX512_TARGET static void adam(std::uint16_t* param, std::uint16_t* extra, Grad* grad,
                                         float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                                         std::int64_t n, RoundingKey key, std::uint32_t first_lo,
                                         AdamStep step) {
    adam_bf16_lanes<Lanes512, Avx512Words, kMode, kWriteGrad, kAmsgrad>(
        param, extra, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, key, first_lo, step);
  }
};

}  // namespace

void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step) {
  Bf16Spans<Kernels>::adam(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                           max_exp_avg_sq, n, step);
}

}  // namespace avx512
#endif

// The modes convert bf16 with shifts, and fp16 grads convert with F16C: the AVX2 loops run
// wherever the processor has AVX2 and F16C, whatever the grad dtype.
void adam_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                    bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                    std::int64_t n, const AdamStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx512()) {
    avx512::adam_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                      max_exp_avg_sq, n, step);
    return;
  }
  if (cpu_has_avx2_f16c()) {
    avx2::adam_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                    n, step);
    return;
  }
#endif
  portable::adam_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                      max_exp_avg_sq, n, step);
}

void sgd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx2_f16c()) {
    avx2::sgd_bf16(param, bf16, grad, grad_dtype, write_grad, momentum_buffer, n, step);
    return;
  }
#endif
  portable::sgd_bf16(param, bf16, grad, grad_dtype, write_grad, momentum_buffer, n, step);
}

void adagrad_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                       bool write_grad, float* sum, std::int64_t n, const AdagradStep& step) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx2_f16c()) {
    avx2::adagrad_bf16(param, bf16, grad, grad_dtype, write_grad, sum, n, step);
    return;
  }
#endif
  portable::adagrad_bf16(param, bf16, grad, grad_dtype, write_grad, sum, n, step);
}

void novograd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                        bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                        float denom) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx2_f16c()) {
    avx2::novograd_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, n, step, denom);
    return;
  }
#endif
  portable::novograd_bf16(param, bf16, grad, grad_dtype, write_grad, exp_avg, n, step, denom);
}

}  // namespace ampfuse::kernels::cpu
