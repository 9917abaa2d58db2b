// Torch-free CPU kernels of the current-scaling FP8 ops (fp8_tensor_scale,
// fp8_cast_transpose[_dbias], fp8_quantize_rowwise). Every cast goes through fp8_math.h's
// scale_to_fp8 and every scale through current_fp8_scale, the rules the CUDA kernels share.
// Matrices are row-major [rows, cols]; each kernel takes a range so the op layer can run
// ranges on torch's thread pool.
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../fp8_math.h"

namespace ampfuse::kernels::cpu {

// The largest abs_bits (fp8_math.h) of n elements of src, 0 for none: an amax with nan winning.
std::uint32_t fp8_amax_span(const void* src, DType src_dtype, std::int64_t n);

// Rows [row_begin, row_end) of src [rows, cols]: dst[r, c] (row-major, [rows, cols]) and
// dst_t[c, r] ([cols, rows]) both get the code of src[r, c] * scale. Returns the rows' amax bits.
std::uint32_t fp8_cast_transpose_rows(const void* src, DType src_dtype, std::int64_t rows,
                                      std::int64_t cols, std::int64_t row_begin,
                                      std::int64_t row_end, float scale, Fp8Format format,
                                      std::uint8_t* dst, std::uint8_t* dst_t);

// sums[c] = sum over every row r of src[r, c], for c in [col_begin, col_end), accumulated in
// fp32 from row 0 down (one fixed order: the result never depends on threading).
void fp8_column_sums(const void* src, DType src_dtype, std::int64_t rows, std::int64_t cols,
                     std::int64_t col_begin, std::int64_t col_end, float* sums);

// Rowwise scaling of rows [row_begin, row_end): each row's scale is current_fp8_scale of its
// own amax (no margin); dst[r, :] gets the row's codes and scale_inv[r] = 1 / that scale.
void fp8_quantize_rows(const void* src, DType src_dtype, std::int64_t cols, std::int64_t row_begin,
                       std::int64_t row_end, Fp8Format format, std::uint8_t* dst, float* scale_inv);

// Columnwise scaling written transposed, for columns [col_begin, col_end): each column c of
// src [rows, cols] gets the scale of its own amax, dst_t[c, r] = code of src[r, c] * scale, and
// scale_inv[c] = 1 / scale.
void fp8_quantize_columns_transposed(const void* src, DType src_dtype, std::int64_t rows,
                                     std::int64_t cols, std::int64_t col_begin,
                                     std::int64_t col_end, Fp8Format format, std::uint8_t* dst_t,
                                     float* scale_inv);

}  // namespace ampfuse::kernels::cpu
