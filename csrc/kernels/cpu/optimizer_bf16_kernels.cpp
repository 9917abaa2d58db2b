// CPU Adam/AdamW, SGD, Adagrad and NovoGrad (second pass) span kernels for bf16 params without
// an fp32 master (master_weights="stochastic", "kahan" and "split"; bf16_modes.h). The loops are
// optimizer_variants.h's with the param read and written through Bf16Param<kMode>: the update
// math is the same optimizer_math.h / adagrad_math.h / novograd_math.h code. bf16 converts with shifts, so these
// scalar loops (with their AVX2 clone) vectorize; options that are off are bit selects here (see
// choose()).
#include "bf16_span.h"

namespace ampfuse::kernels::cpu {
namespace {

template <MasterMode kMode, bool kWriteGrad, bool kAmsgrad, typename Grad>
AMPFUSE_CPU_CLONES void adam_bf16_loop(std::uint16_t* __restrict param,
                                       std::uint16_t* __restrict extra, Grad* __restrict grad,
                                       float* __restrict exp_avg, float* __restrict exp_avg_sq,
                                       float* __restrict max_exp_avg_sq, std::int64_t n,
                                       const RoundingKey key, std::uint32_t first_lo,
                                       const AdamStep step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i,
                                                           step.grad_scale, g);
    float unused = 0.0f;
    adam_update<kAmsgrad>(p, g, exp_avg[i], exp_avg_sq[i], kAmsgrad ? max_exp_avg_sq[i] : unused,
                          step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

template <MasterMode kMode, bool kWriteGrad, bool kMomentum, typename Grad>
AMPFUSE_CPU_CLONES void sgd_bf16_loop(std::uint16_t* __restrict param,
                                      std::uint16_t* __restrict extra, Grad* __restrict grad,
                                      float* __restrict momentum_buffer, std::int64_t n,
                                      const RoundingKey key, std::uint32_t first_lo,
                                      const SgdStep step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i,
                                                           step.grad_scale, g);
    float unused = 0.0f;
    sgd_update<kMomentum>(p, g, kMomentum ? momentum_buffer[i] : unused, step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

// adagrad_update picks the decoupled form with a branch, which GCC does not vectorize around
// ("control flow in loop"); fixing the flag at compile time here removes it.
template <MasterMode kMode, bool kWriteGrad, bool kDecoupled, typename Grad>
AMPFUSE_CPU_CLONES void adagrad_bf16_loop(std::uint16_t* __restrict param,
                                          std::uint16_t* __restrict extra, Grad* __restrict grad,
                                          float* __restrict sum, std::int64_t n,
                                          const RoundingKey key, std::uint32_t first_lo,
                                          AdagradStep step) {
  step.decoupled = kDecoupled;
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i,
                                                           step.grad_scale, g);
    adagrad_update(p, g, sum[i], step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

// As adagrad_bf16_loop, for novograd_update's reg_inside_moment branch.
template <MasterMode kMode, bool kWriteGrad, bool kRegInsideMoment, typename Grad>
AMPFUSE_CPU_CLONES void novograd_bf16_loop(std::uint16_t* __restrict param,
                                           std::uint16_t* __restrict extra,
                                           Grad* __restrict grad, float* __restrict exp_avg,
                                           std::int64_t n, const RoundingKey key,
                                           std::uint32_t first_lo, NovoGradStep step,
                                           float denom) {
  step.reg_inside_moment = kRegInsideMoment;
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i,
                                                           step.grad_scale, g);
    novograd_update(p, g, exp_avg[i], denom, step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

}  // namespace

void adam_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                    bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                    std::int64_t n, const AdamStep& step) {
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    with_flag(step.amsgrad, [&](auto amsgrad) {
      adam_bf16_loop<decltype(mode)::value, write, amsgrad>(
          param, bf16.extra, g, exp_avg, exp_avg_sq, max_exp_avg_sq, n,
          chunk_key(bf16.key, bf16.first_index), static_cast<std::uint32_t>(bf16.first_index),
          step);
    });
  });
}

void sgd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* momentum_buffer, std::int64_t n,
                   const SgdStep& step) {
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    with_flag(momentum_buffer != nullptr, [&](auto has_momentum) {
      sgd_bf16_loop<decltype(mode)::value, write, has_momentum>(
          param, bf16.extra, g, momentum_buffer, n, chunk_key(bf16.key, bf16.first_index),
          static_cast<std::uint32_t>(bf16.first_index), step);
    });
  });
}

void adagrad_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                       bool write_grad, float* sum, std::int64_t n, const AdagradStep& step) {
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    with_flag(step.decoupled, [&](auto decoupled) {
      adagrad_bf16_loop<decltype(mode)::value, write, decoupled>(
          param, bf16.extra, g, sum, n, chunk_key(bf16.key, bf16.first_index),
          static_cast<std::uint32_t>(bf16.first_index), step);
    });
  });
}

void novograd_bf16_span(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                        bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                        float denom) {
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    with_flag(step.reg_inside_moment, [&](auto inside) {
      novograd_bf16_loop<decltype(mode)::value, write, inside>(
          param, bf16.extra, g, exp_avg, n, chunk_key(bf16.key, bf16.first_index),
          static_cast<std::uint32_t>(bf16.first_index), step, denom);
    });
  });
}

}  // namespace ampfuse::kernels::cpu
