// What the CPU paths of the coded-moment ops (fused_adam_coded_, fused_lamb_coded_) hand their
// span kernels: one span's codes and scales.
#pragma once

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

// The moments of span `s`: its first element's codes and its first block's scale (null for a
// moment the lists leave empty, max_exp_avg_sq without amsgrad).
inline kernels::cpu::CodedMoments span_moments(const kernels::cuda::CodedMomentLists& m,
                                               const Span& s) {
  const auto codes = [&](const std::vector<kernels::TensorRef>& list) {
    return list.empty() ? nullptr
                        : static_cast<std::uint8_t*>(list[s.tensor].data) + s.offset;
  };
  const auto scales = [&](const std::vector<kernels::TensorRef>& list) {
    return list.empty() ? nullptr
                        : static_cast<float*>(list[s.tensor].data) +
                              s.offset / kernels::kStateBlock;
  };
  return {m.code,
          codes(m.exp_avg_codes), scales(m.exp_avg_scales),
          codes(m.exp_avg_sq_codes), scales(m.exp_avg_sq_scales),
          codes(m.max_exp_avg_sq_codes), scales(m.max_exp_avg_sq_scales)};
}

}  // namespace ampfuse::ops
