// CPU loops of the current-scaling FP8 ops (declared in fp8_quantize_kernels.h). The element
// arithmetic is fp8_math.h's, so these give the CUDA kernels' bits; the loops are plain and
// branch-free where GCC can vectorize them.
#include "fp8_quantize_kernels.h"

#include <algorithm>
#include <vector>

#include "half_convert.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

// Columns moved per pass of the transpose: a block of 64 source rows x 64 columns keeps both
// the rows read and the 64 destination rows written within L1.
constexpr std::int64_t kBlock = 64;

template <typename Storage>
AMPFUSE_CPU_CLONES std::uint32_t amax_of(const Storage* src, std::int64_t n) {
  std::uint32_t largest = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    largest = std::max(largest, abs_bits(Element<Storage>::load(src[i])));
  }
  return largest;
}

template <Fp8Format kFormat, typename Storage>
AMPFUSE_CPU_CLONES void cast_row(const Storage* src, std::uint8_t* dst, std::int64_t n,
                                 float scale) {
  for (std::int64_t i = 0; i < n; ++i)
    dst[i] = scale_to_fp8<kFormat>(Element<Storage>::load(src[i]), scale);
}

template <Fp8Format kFormat, typename Storage>
std::uint32_t cast_transpose_rows(const Storage* src, std::int64_t rows, std::int64_t cols,
                                  std::int64_t row_begin, std::int64_t row_end, float scale,
                                  std::uint8_t* dst, std::uint8_t* dst_t) {
  std::uint32_t largest = 0;
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    largest = std::max(largest, amax_of(src + r * cols, cols));
    cast_row<kFormat>(src + r * cols, dst + r * cols, cols, scale);
  }
  for (std::int64_t r0 = row_begin; r0 < row_end; r0 += kBlock) {
    const std::int64_t r1 = std::min(row_end, r0 + kBlock);
    for (std::int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const std::int64_t c1 = std::min(cols, c0 + kBlock);
      for (std::int64_t c = c0; c < c1; ++c) {
        for (std::int64_t r = r0; r < r1; ++r) dst_t[c * rows + r] = dst[r * cols + c];
      }
    }
  }
  return largest;
}

template <typename Storage>
AMPFUSE_CPU_CLONES void column_sums(const Storage* src, std::int64_t rows, std::int64_t cols,
                                    std::int64_t col_begin, std::int64_t col_end, float* sums) {
  for (std::int64_t c = col_begin; c < col_end; ++c) sums[c] = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) {
    const Storage* row = src + r * cols;
    for (std::int64_t c = col_begin; c < col_end; ++c) sums[c] += Element<Storage>::load(row[c]);
  }
}

template <Fp8Format kFormat, typename Storage>
void quantize_rows(const Storage* src, std::int64_t cols, std::int64_t row_begin,
                   std::int64_t row_end, std::uint8_t* dst, float* scale_inv) {
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    const float amax = fp8_detail::float_of(amax_of(src + r * cols, cols));
    const float scale = current_fp8_scale(amax, fp8_max(kFormat), 1.0f);
    cast_row<kFormat>(src + r * cols, dst + r * cols, cols, scale);
    scale_inv[r] = fp8_detail::div_rn(1.0f, scale);
  }
}

template <Fp8Format kFormat, typename Storage>
void quantize_columns_transposed(const Storage* src, std::int64_t rows, std::int64_t cols,
                                 std::int64_t col_begin, std::int64_t col_end, std::uint8_t* dst_t,
                                 float* scale_inv) {
  for (std::int64_t c0 = col_begin; c0 < col_end; c0 += kBlock) {
    const std::int64_t c1 = std::min(col_end, c0 + kBlock);
    std::uint32_t largest[kBlock] = {};
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = c0; c < c1; ++c) {
        largest[c - c0] =
            std::max(largest[c - c0], abs_bits(Element<Storage>::load(src[r * cols + c])));
      }
    }
    float scale[kBlock];
    for (std::int64_t c = c0; c < c1; ++c) {
      scale[c - c0] =
          current_fp8_scale(fp8_detail::float_of(largest[c - c0]), fp8_max(kFormat), 1.0f);
      scale_inv[c] = fp8_detail::div_rn(1.0f, scale[c - c0]);
    }
    for (std::int64_t r0 = 0; r0 < rows; r0 += kBlock) {
      const std::int64_t r1 = std::min(rows, r0 + kBlock);
      for (std::int64_t c = c0; c < c1; ++c) {
        for (std::int64_t r = r0; r < r1; ++r) {
          dst_t[c * rows + r] =
              scale_to_fp8<kFormat>(Element<Storage>::load(src[r * cols + c]), scale[c - c0]);
        }
      }
    }
  }
}

// Calls f with the typed source and the format as a compile-time constant.
template <typename F>
auto with_types(const void* src, DType dtype, Fp8Format format, F&& f) {
  return with_storage(dtype, const_cast<void*>(src), [&](auto* typed) {
    return format == Fp8Format::kE4M3
               ? f(typed, std::integral_constant<Fp8Format, Fp8Format::kE4M3>{})
               : f(typed, std::integral_constant<Fp8Format, Fp8Format::kE5M2>{});
  });
}

}  // namespace

std::uint32_t fp8_amax_span(const void* src, DType src_dtype, std::int64_t n) {
  return with_storage(src_dtype, const_cast<void*>(src),
                      [&](auto* typed) { return amax_of(typed, n); });
}

std::uint32_t fp8_cast_transpose_rows(const void* src, DType src_dtype, std::int64_t rows,
                                      std::int64_t cols, std::int64_t row_begin,
                                      std::int64_t row_end, float scale, Fp8Format format,
                                      std::uint8_t* dst, std::uint8_t* dst_t) {
  return with_types(src, src_dtype, format, [&](auto* typed, auto fmt) {
    return cast_transpose_rows<decltype(fmt)::value>(typed, rows, cols, row_begin, row_end, scale,
                                                     dst, dst_t);
  });
}

void fp8_column_sums(const void* src, DType src_dtype, std::int64_t rows, std::int64_t cols,
                     std::int64_t col_begin, std::int64_t col_end, float* sums) {
  with_storage(src_dtype, const_cast<void*>(src),
               [&](auto* typed) { column_sums(typed, rows, cols, col_begin, col_end, sums); });
}

void fp8_quantize_rows(const void* src, DType src_dtype, std::int64_t cols, std::int64_t row_begin,
                       std::int64_t row_end, Fp8Format format, std::uint8_t* dst,
                       float* scale_inv) {
  with_types(src, src_dtype, format, [&](auto* typed, auto fmt) {
    quantize_rows<decltype(fmt)::value>(typed, cols, row_begin, row_end, dst, scale_inv);
  });
}

void fp8_quantize_columns_transposed(const void* src, DType src_dtype, std::int64_t rows,
                                     std::int64_t cols, std::int64_t col_begin,
                                     std::int64_t col_end, Fp8Format format, std::uint8_t* dst_t,
                                     float* scale_inv) {
  with_types(src, src_dtype, format, [&](auto* typed, auto fmt) {
    quantize_columns_transposed<decltype(fmt)::value>(typed, rows, cols, col_begin, col_end, dst_t,
                                                      scale_inv);
  });
}

}  // namespace ampfuse::kernels::cpu
