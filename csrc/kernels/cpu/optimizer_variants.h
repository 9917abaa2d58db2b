// The implementations behind adam_span and sgd_span: portable loops that convert fp16 in
// software, and AVX2+F16C loops (optimizer_kernels_avx2.cpp) that convert in hardware.
// optimizer_kernels.cpp picks one per call; the tests run both and require the same bits.
//
// Both run the element loops below, so the update math is written once (optimizer_math.h)
// and compiled with the same flags (-ffp-contract=off): the AVX2 loops only change how
// fp16/bf16 elements reach and leave those loops.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../dtype.h"
#include "../optimizer_math.h"
#include "half_convert.h"
#include "storage_dispatch.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Options that change which arrays are touched are template parameters, so each
// loop is straight-line code the compiler vectorizes. kWriteGrad stores the unscaled
// grad back in its own dtype (torch's fused optimizers leave p.grad unscaled). master and
// max_exp_avg_sq / momentum_buffer are read only when their flag is set. These carry no
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
                      Kernels::template sgd<has_master, write, has_momentum>(
                          p, g, momentum_buffer, master, n, step);
                    });
                  });
}

// Same signatures as adam_span and sgd_span (cpu_kernels.h).
namespace portable {
void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
          std::int64_t n, const AdamStep& step);
void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
void adam(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
          float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, float* master,
          std::int64_t n, const AdamStep& step);
void sgd(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
         float* momentum_buffer, float* master, std::int64_t n, const SgdStep& step);
}  // namespace avx2
#endif

}  // namespace ampfuse::kernels::cpu
