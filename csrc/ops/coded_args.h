// The arguments the ops over 8-bit coded moments (fused_adam_coded_, fused_lamb_coded_) share:
// state_dtype, each moment's codes and scales checked into CodedMomentLists' refs, and what
// their CPU paths hand the span kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <vector>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../kernels/state_codes.h"
#include "cpu_spans.h"

namespace ampfuse::ops {

// A CPU span then holds whole blocks: the kernels code each block on their own.
static_assert(kernels::kChunkSize % kernels::kStateBlock == 0,
              "CPU spans must hold whole code blocks");

// "int8" or "fp8"; anything else is an error naming `op`, the two, and `fp32_op`, the op that
// steps fp32 moments.
kernels::StateCode parse_state_dtype(const char* op, c10::string_view name, const char* fp32_op);

// One moment of every param checked into `codes_out` and `scales_out` (refs whose dtype is
// unused): codes of the state_dtype's dtype for this moment (int8: torch.int8 for the first
// moment, torch.uint8 for the second; fp8: torch.float8_e4m3fn), shaped and laid out like each
// (dense) param on its device; scales torch.float32, contiguous, 1-D, one per block of
// kStateBlock elements. `optional`: two empty lists are accepted (max_exp_avg_sq without
// amsgrad).
void check_coded_moment(const char* op, at::TensorList params, at::TensorList codes,
                        const char* codes_name, at::TensorList scales, const char* scales_name,
                        kernels::StateCode code, bool second, bool optional,
                        std::vector<kernels::TensorRef>& codes_out,
                        std::vector<kernels::TensorRef>& scales_out);

// The moments of span `s`: its first element's codes and its first block's scale (null for a
// moment the lists leave empty, max_exp_avg_sq without amsgrad).
inline kernels::cpu::CodedMoments span_moments(const kernels::cuda::CodedMomentLists& m,
                                               const Span& s) {
  const auto codes = [&](const std::vector<kernels::TensorRef>& list) {
    return list.empty() ? nullptr : static_cast<std::uint8_t*>(list[s.tensor].data) + s.offset;
  };
  const auto scales = [&](const std::vector<kernels::TensorRef>& list) {
    return list.empty()
               ? nullptr
               : static_cast<float*>(list[s.tensor].data) + s.offset / kernels::kStateBlock;
  };
  return {m.code,
          codes(m.exp_avg_codes),
          scales(m.exp_avg_scales),
          codes(m.exp_avg_sq_codes),
          scales(m.exp_avg_sq_scales),
          codes(m.max_exp_avg_sq_codes),
          scales(m.max_exp_avg_sq_scales)};
}

}  // namespace ampfuse::ops
