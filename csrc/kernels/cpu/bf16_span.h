// Reading and writing one element of a bf16 param in a master-free mode (Bf16Span,
// bf16_modes.h) from the CPU span loops: the last n % 8 elements of the Adam, SGD, Adagrad and
// NovoGrad loops (bf16_variants.h) and of LAMB's two passes (lamb_kernels.cpp), so that every
// optimizer loads the same value and draws the same stochastic bits for an element; the other
// elements go eight at a time through bf16_lanes.h, which gives the same bits.
#pragma once

#include "../bf16_modes.h"
#include "cpu_kernels.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {

// The value element i's update starts from; `extra` is not read in kStochastic, which has none.
template <MasterMode kMode>
AMPFUSE_BF16_INLINE float load_bf16_param(const std::uint16_t* __restrict param,
                                          const std::uint16_t* __restrict extra, std::int64_t i) {
  return Bf16Param<kMode>::load(param[i], kMode == MasterMode::kStochastic ? 0 : extra[i]);
}

// Reads element i's grad (unscaled, written back with kWriteGrad) and its param's value.
template <MasterMode kMode, bool kWriteGrad, typename Grad>
AMPFUSE_BF16_INLINE float load_bf16_param_and_grad(const std::uint16_t* __restrict param,
                                                   const std::uint16_t* __restrict extra,
                                                   Grad* __restrict grad, std::int64_t i,
                                                   float grad_scale, float& g) {
  g = unscale_grad(Element<Grad>::load(grad[i]), grad_scale);
  if (kWriteGrad) grad[i] = Element<Grad>::store(g);
  return load_bf16_param<kMode>(param, extra, i);
}

// `key` is the span's chunk_key and `first_lo` the low word of its first element's index.
template <MasterMode kMode>
AMPFUSE_BF16_INLINE void store_bf16_param(float p, std::uint16_t* __restrict param,
                                          std::uint16_t* __restrict extra, std::int64_t i,
                                          const RoundingKey& key, std::uint32_t first_lo) {
  std::uint16_t new_param, new_extra;
  const std::uint32_t random16 = kMode == MasterMode::kStochastic
                                     ? rounding_bits(key, first_lo + static_cast<std::uint32_t>(i))
                                     : 0u;
  Bf16Param<kMode>::store(p, new_param, new_extra, random16);
  param[i] = new_param;
  if constexpr (kMode != MasterMode::kStochastic) extra[i] = new_extra;
}

// Calls f(mode, typed grad, write_grad) for one span.
template <typename F>
void with_bf16_span_types(const Bf16Span& bf16, void* grad, DType grad_dtype, bool write_grad,
                          F&& f) {
  with_bf16_mode(bf16.mode, [&](auto mode) {
    with_storage(grad_dtype, grad,
                 [&](auto* g) { with_flag(write_grad, [&](auto write) { f(mode, g, write); }); });
  });
}

}  // namespace ampfuse::kernels::cpu
