// Block-coded moments (state_codes.h) to fp32 and back over a CPU span: what fused_lamb_coded_
// (csrc/ops/lamb_coded.cpp) runs around the fp32 LAMB span kernels, in stack-free loops built
// with the kernels' flags (-O3, no FMA contraction).
#pragma once

#include <cstdint>

#include "../state_codes.h"

namespace ampfuse::kernels::cpu {

// Elements [first, first + n) of one param's moment: `codes` and `scales` are the whole
// param's (first must be a multiple of kStateBlock; the span then holds whole blocks, the last
// of the param possibly short). decode writes moment[0, n); encode codes moment[0, n) back,
// block by block as encode_block does.
void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment);
void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales);

}  // namespace ampfuse::kernels::cpu
