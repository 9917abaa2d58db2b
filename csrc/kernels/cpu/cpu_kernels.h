// Torch-free CPU kernels. Each works on one contiguous span of elements; the op
// layer splits lists into spans and runs them on torch's thread pool.
#pragma once

#include <cstdint>

#include "../dtype.h"

namespace ampfuse::kernels::cpu {

// data[i] *= inv_scale in fp32 math. Returns true if any input element is inf or nan.
bool unscale_span(void* data, DType dtype, std::int64_t n, float inv_scale);

// dst[i] = src[i] * scale in fp32 math, cast to dst's type. Returns true if any
// src element is inf or nan. src and dst may be the same span (same dtype).
bool scale_span(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                float scale);

// Sum of squares of the span, accumulated in fp32 lanes and returned as double.
double sum_of_squares_span(const void* data, DType dtype, std::int64_t n);

}  // namespace ampfuse::kernels::cpu
