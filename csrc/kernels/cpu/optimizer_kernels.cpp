// CPU Adam/AdamW and SGD span kernels: one pass reads the gradient, updates the
// fp32 state and writes the parameter (and its master) back.
#include "cpu_kernels.h"
#include "half_convert.h"
#include "storage_dispatch.h"

#include <type_traits>

namespace ampfuse::kernels::cpu {
namespace {

// Options that change which arrays are touched are template parameters, so each
// loop is straight-line code the compiler vectorizes.
template <bool kMaster, bool kAmsgrad, typename Param, typename Grad>
AMPFUSE_CPU_CLONES void adam_typed(Param* __restrict param, const Grad* __restrict grad,
                                   float* __restrict exp_avg, float* __restrict exp_avg_sq,
                                   float* __restrict max_exp_avg_sq, float* __restrict master,
                                   std::int64_t n, const AdamStep step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float p = kMaster ? master[i] : Element<Param>::load(param[i]);
    float unused = 0.0f;
    adam_update<kAmsgrad>(p, Element<Grad>::load(grad[i]), exp_avg[i], exp_avg_sq[i],
                          kAmsgrad ? max_exp_avg_sq[i] : unused, step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <bool kMaster, bool kMomentum, typename Param, typename Grad>
AMPFUSE_CPU_CLONES void sgd_typed(Param* __restrict param, const Grad* __restrict grad,
                                  float* __restrict momentum_buffer, float* __restrict master,
                                  std::int64_t n, const SgdConfig config, float lr,
                                  float grad_factor, bool first_step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float p = kMaster ? master[i] : Element<Param>::load(param[i]);
    float unused = 0.0f;
    sgd_update<kMomentum>(p, Element<Grad>::load(grad[i]), kMomentum ? momentum_buffer[i] : unused,
                          config, lr, grad_factor, first_step);
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

}  // namespace

void adam_span(void* param, DType param_dtype, const void* grad, DType grad_dtype, float* exp_avg,
               float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
               const AdamStep& step) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_storage(grad_dtype, const_cast<void*>(grad), [&](auto* g) {
      with_flag(master != nullptr, [&](auto has_master) {
        with_flag(step.amsgrad, [&](auto amsgrad) {
          adam_typed<has_master, amsgrad>(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, master, n,
                                          step);
        });
      });
    });
  });
}

void sgd_span(void* param, DType param_dtype, const void* grad, DType grad_dtype,
              float* momentum_buffer, float* master, std::int64_t n, const SgdConfig& config,
              float lr, float grad_factor, bool first_step) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_storage(grad_dtype, const_cast<void*>(grad), [&](auto* g) {
      with_flag(master != nullptr, [&](auto has_master) {
        with_flag(momentum_buffer != nullptr, [&](auto has_momentum) {
          sgd_typed<has_master, has_momentum>(p, g, momentum_buffer, master, n, config, lr,
                                              grad_factor, first_step);
        });
      });
    });
  });
}

}  // namespace ampfuse::kernels::cpu
