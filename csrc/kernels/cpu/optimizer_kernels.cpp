// CPU Adam/AdamW and SGD span kernels: one pass reads the gradient, updates the
// fp32 state and writes the parameter (and its master) back.
#include "cpu_kernels.h"
#include "half_convert.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

template <bool kMaster, typename Param, typename Grad>
AMPFUSE_CPU_CLONES void adam_typed(Param* param, const Grad* grad, float* exp_avg,
                                   float* exp_avg_sq, float* max_exp_avg_sq, float* master,
                                   std::int64_t n, const AdamStep& step) {
  float unused_max = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    float p = kMaster ? master[i] : Element<Param>::load(param[i]);
    float& max_v = max_exp_avg_sq != nullptr ? max_exp_avg_sq[i] : unused_max;
    adam_update(p, Element<Grad>::load(grad[i]), exp_avg[i], exp_avg_sq[i], max_v, step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <bool kMaster, typename Param, typename Grad>
AMPFUSE_CPU_CLONES void sgd_typed(Param* param, const Grad* grad, float* momentum_buffer,
                                  float* master, std::int64_t n, const SgdConfig& config, float lr,
                                  float grad_factor, bool first_step) {
  for (std::int64_t i = 0; i < n; ++i) {
    float p = kMaster ? master[i] : Element<Param>::load(param[i]);
    sgd_update(p, Element<Grad>::load(grad[i]),
               momentum_buffer != nullptr ? momentum_buffer + i : nullptr, config, lr,
               grad_factor, first_step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

}  // namespace

void adam_span(void* param, DType param_dtype, const void* grad, DType grad_dtype, float* exp_avg,
               float* exp_avg_sq, float* max_exp_avg_sq, float* master, std::int64_t n,
               const AdamStep& step) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_storage(grad_dtype, const_cast<void*>(grad), [&](auto* g) {
      if (master != nullptr) {
        adam_typed<true>(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, master, n, step);
      } else {
        adam_typed<false>(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, master, n, step);
      }
    });
  });
}

void sgd_span(void* param, DType param_dtype, const void* grad, DType grad_dtype,
              float* momentum_buffer, float* master, std::int64_t n, const SgdConfig& config,
              float lr, float grad_factor, bool first_step) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_storage(grad_dtype, const_cast<void*>(grad), [&](auto* g) {
      if (master != nullptr) {
        sgd_typed<true>(p, g, momentum_buffer, master, n, config, lr, grad_factor, first_step);
      } else {
        sgd_typed<false>(p, g, momentum_buffer, master, n, config, lr, grad_factor, first_step);
      }
    });
  });
}

}  // namespace ampfuse::kernels::cpu
