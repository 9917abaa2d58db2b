// Torch-free CPU kernels of the FP8 ops (fp8_math.h holds the arithmetic they share with
// the CUDA kernels).
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../fp8_math.h"

namespace ampfuse::kernels::cpu {

// dst[i] = fp8 code of src[i] * scale saturated to the format's range, for a span of n
// elements of src's dtype. Returns the largest abs_bits (fp8_math.h) of the unscaled
// src elements, 0 for an empty span.
std::uint32_t fp8_cast_amax_span(const void* src, DType src_dtype, std::uint8_t* dst,
                                 std::int64_t n, float scale, Fp8Format format);

}  // namespace ampfuse::kernels::cpu
