// The implementations behind adam_span, sgd_span and adagrad_span: 8-lane loops (adam_lanes,
// sgd_lanes, adagrad_lanes) that
// convert fp16/bf16 in software (portable::, optimizer_kernels.cpp) or with F16C (avx2::,
// optimizer_kernels_avx2.cpp). optimizer_kernels.cpp picks one per call; the tests run both and
// require the same bits.
//
// Both run the element updates of optimizer_math.h, so the math is written once and compiled
// with the same flags (-ffp-contract=off): the two only differ in how fp16/bf16 elements reach
// and leave the lanes. The scalar loops below take the last n % 8 elements.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../adagrad_math.h"
#include "../dtype.h"
#include "../optimizer_math.h"
#include "half_convert.h"
#include "lanes8.h"
#include "storage_dispatch.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Options that change which arrays are touched are template parameters. kWriteGrad stores the
// unscaled grad back in its own dtype (torch's fused optimizers leave p.grad unscaled). master
// and max_exp_avg_sq / momentum_buffer are read only when their flag is set. These carry no
// target attribute, so each caller inlines them for its own instruction set.
template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
inline float load_param_and_grad(const Param* __restrict param, Grad* __restrict grad,
                                 const float* __restrict master, std::int64_t i, float grad_scale,
                                 float& g) {
  g = unscale_grad(Element<Grad>::load(grad[i]), grad_scale);
  if (kWriteGrad) grad[i] = Element<Grad>::store(g);
  return kMaster ? master[i] : Element<Param>::load(param[i]);
}

template <bool kMaster, bool kWriteGrad, bool kAmsgrad, typename Param, typename Grad>
inline void adam_loop(Param* __restrict param, Grad* __restrict grad, float* __restrict exp_avg,
                      float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq,
                      float* __restrict master, std::int64_t n, const AdamStep& step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_param_and_grad<kMaster, kWriteGrad>(param, grad, master, i, step.grad_scale, g);
    float unused = 0.0f;
    adam_update<kAmsgrad>(p, g, exp_avg[i], exp_avg_sq[i], kAmsgrad ? max_exp_avg_sq[i] : unused,
                          step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <bool kMaster, bool kWriteGrad, bool kMomentum, typename Param, typename Grad>
inline void sgd_loop(Param* __restrict param, Grad* __restrict grad,
                     float* __restrict momentum_buffer, float* __restrict master, std::int64_t n,
                     const SgdStep& step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_param_and_grad<kMaster, kWriteGrad>(param, grad, master, i, step.grad_scale, g);
    float unused = 0.0f;
    sgd_update<kMomentum>(p, g, kMomentum ? momentum_buffer[i] : unused, step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
inline void adagrad_loop(Param* __restrict param, Grad* __restrict grad, float* __restrict sum,
                         float* __restrict master, std::int64_t n, const AdagradStep& step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_param_and_grad<kMaster, kWriteGrad>(param, grad, master, i, step.grad_scale, g);
    adagrad_update(p, g, sum[i], step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

// Where the 8-lane Adam loops (adam_lanes, adam_bf16_lanes) keep the moments. These are fp32
// arrays; adam_coded_avx2.cpp holds them as 8-bit block codes, decoded in load and gathered for
// coding in store. Lanes<float> moves the fp32 lanes. `root` is the update's sqrt(v) (or
// sqrt(max_v)), which fp32 moments have no use for.
struct FloatMoments {
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless kAmsgrad

  template <template <typename> class Lanes, bool kAmsgrad, typename L>
  inline __attribute__((always_inline)) void load(std::int64_t i, L& m, L& v, L& max_v) const {
    m = Lanes<float>::load(exp_avg + i);
    v = Lanes<float>::load(exp_avg_sq + i);
    if (kAmsgrad) max_v = Lanes<float>::load(max_exp_avg_sq + i);
  }
  template <template <typename> class Lanes, bool kAmsgrad, typename L>
  inline __attribute__((always_inline)) void store(std::int64_t i, L m, L v, L max_v,
                                                   L /*root*/) const {
    Lanes<float>::store(exp_avg + i, m);
    Lanes<float>::store(exp_avg_sq + i, v);
    if (kAmsgrad) Lanes<float>::store(max_exp_avg_sq + i, max_v);
  }
  // The arrays the scalar loop steps for elements [i, n), and what follows that loop.
  FloatMoments scalar_tail(std::int64_t i, std::int64_t /*n*/) const {
    return {exp_avg + i, exp_avg_sq + i, max_exp_avg_sq != nullptr ? max_exp_avg_sq + i : nullptr};
  }
  void after_scalar_tail(std::int64_t /*i*/, std::int64_t /*n*/) const {}
};

// The loops above eight elements at a time, on Lanes8 (lanes8.h), then the last n % 8 elements
// on the scalar loops. Lanes<Storage>::load(p) and store(p, lanes) move eight elements of one
// storage type: PortableLanes, or the F16C conversions of the AVX2 kernels. adam_lanes takes its
// width from them: sixteen for the AVX-512 coded step's (adam_coded_avx512.cpp). A per-step option
// is a predicted branch per eight elements here, and skips its arithmetic (see choose()).
// Always inlined, so the lanes are compiled for the instruction set of the caller. Moments is
// FloatMoments, or another holder with its members (adam_coded_avx2.cpp).
template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, bool kAmsgrad,
          typename Param, typename Grad, typename Moments>
inline __attribute__((always_inline)) void adam_lanes(Param* param, Grad* grad, Moments& moments,
                                                      float* master, std::int64_t n,
                                                      const AdamStep& step_in) {
  // A copy: through the reference, every store to the float arrays might change the step
  // constants, so GCC would reload and broadcast each of them in every iteration.
  const AdamStep step = step_in;
  using L = decltype(Lanes<float>::load(static_cast<const float*>(nullptr)));
  constexpr int kWidth = L::kWidth;
  const std::int64_t whole = n - n % kWidth;
  for (std::int64_t i = 0; i < whole; i += kWidth) {
    L g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    L p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
    L m, v, max_v, root;
    moments.template load<Lanes, kAmsgrad>(i, m, v, max_v);
    adam_update<kAmsgrad>(p, g, m, v, max_v, step, root);
    moments.template store<Lanes, kAmsgrad>(i, m, v, max_v, root);
    if (kMaster) Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  const FloatMoments tail = moments.scalar_tail(whole, n);
  adam_loop<kMaster, kWriteGrad, kAmsgrad>(param + whole, grad + whole, tail.exp_avg,
                                           tail.exp_avg_sq, tail.max_exp_avg_sq,
                                           kMaster ? master + whole : nullptr, n - whole, step);
  moments.after_scalar_tail(whole, n);
}

template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, bool kAmsgrad,
          typename Param, typename Grad>
inline __attribute__((always_inline)) void adam_lanes(Param* param, Grad* grad, float* exp_avg,
                                                      float* exp_avg_sq, float* max_exp_avg_sq,
                                                      float* master, std::int64_t n,
                                                      const AdamStep& step) {
  FloatMoments moments{exp_avg, exp_avg_sq, max_exp_avg_sq};
  adam_lanes<Lanes, kMaster, kWriteGrad, kAmsgrad>(param, grad, moments, master, n, step);
}

template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, bool kMomentum,
          typename Param, typename Grad>
inline __attribute__((always_inline)) void sgd_lanes(Param* param, Grad* grad,
                                                     float* momentum_buffer, float* master,
                                                     std::int64_t n, const SgdStep& step_in) {
  const SgdStep step = step_in;  // a copy, as in adam_lanes
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
    Lanes8 buf = kMomentum ? Lanes<float>::load(momentum_buffer + i) : Lanes8();
    sgd_update<kMomentum>(p, g, buf, step);
    if (kMomentum) Lanes<float>::store(momentum_buffer + i, buf);
    if (kMaster) Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  sgd_loop<kMaster, kWriteGrad, kMomentum>(param + whole, grad + whole,
                                           kMomentum ? momentum_buffer + whole : nullptr,
                                           kMaster ? master + whole : nullptr, n - whole, step);
}

template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, typename Param,
          typename Grad>
inline __attribute__((always_inline)) void adagrad_lanes(Param* param, Grad* grad, float* sum,
                                                         float* master, std::int64_t n,
                                                         const AdagradStep& step_in) {
  const AdagradStep step = step_in;  // a copy, as in adam_lanes
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
    Lanes8 h = Lanes<float>::load(sum + i);
    adagrad_update(p, g, h, step);
    Lanes<float>::store(sum + i, h);
    if (kMaster) Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  adagrad_loop<kMaster, kWriteGrad>(param + whole, grad + whole, sum + whole,
                                    kMaster ? master + whole : nullptr, n - whole, step);
}

// Calls f with std::integral_constant<bool, flag>, turning a runtime flag into a template one.
template <typename F>
void with_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Calls f(param, grad, has_master, write_grad) with typed pointers and flag constants.
template <typename F>
void with_span_types(void* param, DType param_dtype, void* grad, DType grad_dtype, bool has_master,
                     bool write_grad, F&& f) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_storage(grad_dtype, grad, [&](auto* g) {
      with_flag(has_master, [&](auto master) {
        with_flag(write_grad, [&](auto write) { f(p, g, master, write); });
      });
    });
  });
}

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::adam<kMaster, kWriteGrad, kAmsgrad>(param, grad, exp_avg,
// exp_avg_sq, max_exp_avg_sq, master, n, step) and Kernels::sgd<kMaster, kWriteGrad,
// kMomentum>(param, grad, momentum_buffer, master, n, step), with typed pointers.
template <typename Kernels>
void adam_any(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
              float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
              std::int64_t n, const AdamStep& step) {
  with_span_types(param, param_dtype, grad, grad_dtype, master != nullptr, write_grad,
                  [&](auto* p, auto* g, auto has_master, auto write) {
                    with_flag(step.amsgrad, [&](auto amsgrad) {
                      Kernels::template adam<has_master, write, amsgrad>(
                          p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, master, n, step);
                    });
                  });
}

template <typename Kernels>
void sgd_any(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
             float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step) {
  with_span_types(param, param_dtype, grad, grad_dtype, master != nullptr, write_grad,
                  [&](auto* p, auto* g, auto has_master, auto write) {
                    with_flag(momentum_buffer != nullptr, [&](auto has_momentum) {
                      Kernels::template sgd<has_master, write, has_momentum>(p, g, momentum_buffer,
                                                                             master, n, step);
                    });
                  });
}

template <typename Kernels>
void adagrad_any(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                 float* sum, float* master, std::int64_t n, const AdagradStep& step) {
  with_span_types(param, param_dtype, grad, grad_dtype, master != nullptr, write_grad,
                  [&](auto* p, auto* g, auto has_master, auto write) {
                    Kernels::template adagrad<has_master, write>(p, g, sum, master, n, step);
                  });
}

// Same signatures as adam_span, sgd_span and adagrad_span (cpu_kernels.h).
namespace portable {
void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
          const AdamStep& step);
void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step);
void adagrad(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
             float* sum, float* master, std::int64_t n, const AdagradStep& step);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Whether a span of these dtypes runs the avx2:: kernels: where the processor has F16C and a
// half type is involved. fp32-only spans gain nothing from F16C: the portable loops' AVX2 clone
// serves them. Every CPU optimizer kernel file picks its variant with this.
inline bool use_avx2(DType param_dtype, DType grad_dtype) {
  return (param_dtype != DType::kFloat32 || grad_dtype != DType::kFloat32) && cpu_has_avx2_f16c();
}

// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
// Eight elements to and from lanes with the F16C conversions of vec_avx2.h (the avx2:: kernels'
// counterpart of PortableLanes).
template <typename Storage>
struct F16cLanes {
  AMPFUSE_AVX2 static Lanes8 load(const Storage* p) { return Lanes8(Vec8<Storage>::load(p)); }
  AMPFUSE_AVX2 static void store(Storage* p, Lanes8 x) { Vec8<Storage>::store(p, x.v); }
};

void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
          const AdamStep& step);
void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step);
void adagrad(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
             float* sum, float* master, std::int64_t n, const AdagradStep& step);
}  // namespace avx2
// Adam sixteen lanes at a time; call only where cpu_has_avx512() (optimizer_kernels_avx512.cpp).
namespace avx512 {
void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
          const AdamStep& step);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
