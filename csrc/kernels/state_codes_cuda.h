// Block-coded moments (state_codes.h) to fp32 and back on CUDA, one param's moment per call:
// what fused_lamb_coded_ runs around the fp32 LAMB launcher (csrc/ops/lamb_coded.cpp). Codes
// and moment are walked flat in memory order; block k is elements [256k, 256k + 256) with
// scale k, the last one possibly short.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "state_codes.h"

namespace ampfuse::kernels::cuda {

// moment[i] = decode_moment(codes[i], scales[i / 256]) for i < numel.
void decode_moment_blocks(const std::uint8_t* codes, const float* scales, float* moment,
                          std::int64_t numel, StateCode code, bool second, StreamHandle stream);

// Codes `moment` block by block as encode_block does (the absmax of coded_value over the block,
// nan kept, then encode_moment of each element); writes nothing when found_inf (a device
// float, may be null) is nonzero, so a skipped step leaves the codes as they were.
void encode_moment_blocks(const float* moment, std::uint8_t* codes, float* scales,
                          std::int64_t numel, StateCode code, bool second, const float* found_inf,
                          StreamHandle stream);

}  // namespace ampfuse::kernels::cuda
