// The two implementations behind adam_bf16_span, sgd_bf16_span, adagrad_bf16_span and
// novograd_bf16_span (cpu_kernels.h), both in optimizer_bf16_kernels.cpp: the fp32-master loops
// of optimizer_variants.h eight elements at a time, with the param read and written through its
// master-free mode (bf16_lanes.h) and the last n % 8 elements one at a time (bf16_span.h).
// portable:: converts grads and bf16 words in software (cloned for AVX2 where the processor has
// it), avx2:: with F16C and AVX2 instructions. The public spans pick one per call; the tests run
// both and require the same bits, as for the fp32-master kernels.
#pragma once

#include <cstdint>

#include "bf16_lanes.h"
#include "bf16_span.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {

// Each loop takes its step by value, a copy that no store to the arrays can alias (see
// adam_lanes). Lanes<Storage> moves grads and fp32 state, Words the mode's 16-bit words.
// Moments as in adam_lanes.
template <template <typename> class Lanes, typename Words, MasterMode kMode, bool kWriteGrad,
          bool kAmsgrad, typename Grad, typename Moments>
inline __attribute__((always_inline)) void adam_bf16_lanes(std::uint16_t* __restrict param,
                                                           std::uint16_t* __restrict extra,
                                                           Grad* __restrict grad, Moments& moments,
                                                           std::int64_t n, const RoundingKey key,
                                                           std::uint32_t first_lo,
                                                           const AdamStep step) {
  using Mode = Bf16ModeLanes<kMode, Words>;
  using L = typename Words::Lanes;  // eight lanes, or sixteen (adam_coded_avx512.cpp)
  constexpr int kWidth = L::kWidth;
  const std::int64_t whole = n - n % kWidth;
  for (std::int64_t i = 0; i < whole; i += kWidth) {
    L g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    L p = Mode::load(param, extra, i);
    L m, v, max_v, root;
    moments.template load<Lanes, kAmsgrad>(i, m, v, max_v);
    adam_update<kAmsgrad>(p, g, m, v, max_v, step, root);
    moments.template store<Lanes, kAmsgrad>(i, m, v, max_v, root);
    Mode::store(p, param, extra, i, key, first_lo);
  }
  const FloatMoments tail = moments.scalar_tail(whole, n);
  for (std::int64_t i = whole; i < n; ++i) {
    float g;
    float p =
        load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i, step.grad_scale, g);
    float unused = 0.0f;
    const std::int64_t t = i - whole;
    adam_update<kAmsgrad>(p, g, tail.exp_avg[t], tail.exp_avg_sq[t],
                          kAmsgrad ? tail.max_exp_avg_sq[t] : unused, step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
  moments.after_scalar_tail(whole, n);
}

template <template <typename> class Lanes, typename Words, MasterMode kMode, bool kWriteGrad,
          bool kAmsgrad, typename Grad>
inline __attribute__((always_inline)) void adam_bf16_lanes(
    std::uint16_t* __restrict param, std::uint16_t* __restrict extra, Grad* __restrict grad,
    float* __restrict exp_avg, float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq,
    std::int64_t n, const RoundingKey key, std::uint32_t first_lo, const AdamStep step) {
  FloatMoments moments{exp_avg, exp_avg_sq, max_exp_avg_sq};
  adam_bf16_lanes<Lanes, Words, kMode, kWriteGrad, kAmsgrad>(param, extra, grad, moments, n, key,
                                                             first_lo, step);
}

template <template <typename> class Lanes, typename Words, MasterMode kMode, bool kWriteGrad,
          bool kMomentum, typename Grad>
inline __attribute__((always_inline)) void sgd_bf16_lanes(
    std::uint16_t* __restrict param, std::uint16_t* __restrict extra, Grad* __restrict grad,
    float* __restrict momentum_buffer, std::int64_t n, const RoundingKey key,
    std::uint32_t first_lo, const SgdStep step) {
  using Mode = Bf16ModeLanes<kMode, Words>;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = Mode::load(param, extra, i);
    Lanes8 buf = kMomentum ? Lanes<float>::load(momentum_buffer + i) : Lanes8();
    sgd_update<kMomentum>(p, g, buf, step);
    if (kMomentum) Lanes<float>::store(momentum_buffer + i, buf);
    Mode::store(p, param, extra, i, key, first_lo);
  }
  for (std::int64_t i = whole; i < n; ++i) {
    float g;
    float p =
        load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i, step.grad_scale, g);
    float unused = 0.0f;
    sgd_update<kMomentum>(p, g, kMomentum ? momentum_buffer[i] : unused, step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

// kDecoupled fixes adagrad_update's branch at compile time, so the scalar tail if-converts.
template <template <typename> class Lanes, typename Words, MasterMode kMode, bool kWriteGrad,
          bool kDecoupled, typename Grad>
inline __attribute__((always_inline)) void adagrad_bf16_lanes(
    std::uint16_t* __restrict param, std::uint16_t* __restrict extra, Grad* __restrict grad,
    float* __restrict sum, std::int64_t n, const RoundingKey key, std::uint32_t first_lo,
    AdagradStep step) {
  using Mode = Bf16ModeLanes<kMode, Words>;
  step.decoupled = kDecoupled;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = Mode::load(param, extra, i);
    Lanes8 h = Lanes<float>::load(sum + i);
    adagrad_update(p, g, h, step);
    Lanes<float>::store(sum + i, h);
    Mode::store(p, param, extra, i, key, first_lo);
  }
  for (std::int64_t i = whole; i < n; ++i) {
    float g;
    float p =
        load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i, step.grad_scale, g);
    adagrad_update(p, g, sum[i], step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

// As adagrad_bf16_lanes, for novograd_update's reg_inside_moment branch.
template <template <typename> class Lanes, typename Words, MasterMode kMode, bool kWriteGrad,
          bool kRegInsideMoment, typename Grad>
inline __attribute__((always_inline)) void novograd_bf16_lanes(
    std::uint16_t* __restrict param, std::uint16_t* __restrict extra, Grad* __restrict grad,
    float* __restrict exp_avg, std::int64_t n, const RoundingKey key, std::uint32_t first_lo,
    NovoGradStep step, float denom) {
  using Mode = Bf16ModeLanes<kMode, Words>;
  step.reg_inside_moment = kRegInsideMoment;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = Mode::load(param, extra, i);
    Lanes8 m = Lanes<float>::load(exp_avg + i);
    novograd_update(p, g, m, denom, step);
    Lanes<float>::store(exp_avg + i, m);
    Mode::store(p, param, extra, i, key, first_lo);
  }
  for (std::int64_t i = whole; i < n; ++i) {
    float g;
    float p =
        load_bf16_param_and_grad<kMode, kWriteGrad>(param, extra, grad, i, step.grad_scale, g);
    novograd_update(p, g, exp_avg[i], denom, step);
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
}

// Same signatures as the *_bf16_span functions (cpu_kernels.h).
namespace portable {
void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step);
void sgd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
              bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step);
void adagrad_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                  bool write_grad, float* sum, std::int64_t n, const AdagradStep& step);
void novograd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                   float denom);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step);
void sgd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
              bool write_grad, float* momentum_buffer, std::int64_t n, const SgdStep& step);
void adagrad_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                  bool write_grad, float* sum, std::int64_t n, const AdagradStep& step);
void novograd_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
                   bool write_grad, float* exp_avg, std::int64_t n, const NovoGradStep& step,
                   float denom);
}  // namespace avx2
// Adam sixteen lanes at a time; call only where cpu_has_avx512() (optimizer_kernels_avx512.cpp).
namespace avx512 {
void adam_bf16(std::uint16_t* param, const Bf16Span& bf16, void* grad, DType grad_dtype,
               bool write_grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               std::int64_t n, const AdamStep& step);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
