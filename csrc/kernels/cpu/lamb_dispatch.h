// The runtime-dtype entry points of the LAMB span kernels, for each implementation's file
// (lamb_kernels.cpp, lamb_kernels_avx512.cpp) to instantiate with its own loops.
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "bf16_span.h"
#include "cpu_kernels.h"
#include "lamb_lanes.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::moments<kWriteGrad>(source, grad, exp_avg, exp_avg_sq, n, step,
// sums) and Kernels::apply(source, exp_avg, exp_avg_sq, n, step, ratio). The span's sums are
// formed from zero and then added to *param_sq, *update_sq.
template <typename Kernels>
void lamb_moments_any(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                      bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                      std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  SquareSums sums;
  // The first pass only reads the param and the master.
  with_span_types(const_cast<void*>(param), param_dtype, grad, grad_dtype, master != nullptr,
                  write_grad, [&](auto* p, auto* g, auto has_master, auto write) {
                    Kernels::template moments<write>(
                        param_source<has_master>(p, const_cast<float*>(master)), g, exp_avg,
                        exp_avg_sq, n, step, sums);
                  });
  *param_sq += sums.param;
  *update_sq += sums.update;
}

template <typename Kernels>
void lamb_apply_any(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                    float* master, std::int64_t n, const LambStep& step, float ratio) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_flag(master != nullptr, [&](auto has_master) {
      Kernels::apply(param_source<has_master>(p, master), exp_avg, exp_avg_sq, n, step, ratio);
    });
  });
}

// The same for a bf16 param in a master-free mode, its vectors moved by `Words`.
template <typename Kernels, typename Words>
void lamb_moments_bf16_any(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                           DType grad_dtype, bool write_grad, float* exp_avg, float* exp_avg_sq,
                           std::int64_t n, const LambStep& step, double* param_sq,
                           double* update_sq) {
  SquareSums sums;
  auto* bits = const_cast<std::uint16_t*>(param);
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    Kernels::template moments<write>(bf16_source<decltype(mode)::value, Words>(bits, bf16), g,
                                     exp_avg, exp_avg_sq, n, step, sums);
  });
  *param_sq += sums.param;
  *update_sq += sums.update;
}

template <typename Kernels, typename Words>
void lamb_apply_bf16_any(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                         const float* exp_avg_sq, std::int64_t n, const LambStep& step,
                         float ratio) {
  with_bf16_mode(bf16.mode, [&](auto mode) {
    Kernels::apply(bf16_source<decltype(mode)::value, Words>(param, bf16), exp_avg, exp_avg_sq, n,
                   step, ratio);
  });
}

}  // namespace ampfuse::kernels::cpu
