// The AVX2+F16C span kernels (see span_variants.h). Each loop body handles 16 elements
// as two registers of floats; the last n % 16 elements go through half_convert.h's
// scalar conversions, which give the same bits as the vector ones.
#include "span_variants.h"

#ifdef AMPFUSE_HAVE_AVX2_PATH

namespace ampfuse::kernels::cpu::avx2 {
namespace {

struct Kernels {
  // dst = src * factor; also serves unscale in place (src == dst: each element is read
  // before it is written). Returns the kinds of non-finite src elements.
  template <typename Src, typename Dst>
  AMPFUSE_AVX2 static std::uint32_t scale(const Src* src, Dst* dst, std::int64_t n, float factor);

  template <typename Storage>
  AMPFUSE_AVX2 static double sum_of_squares(const Storage* data, std::int64_t n);
};

// The kinds of non-finite lanes of a and b; only called once a lane was seen non-finite.
AMPFUSE_AVX2 std::uint32_t lane_kinds(__m256 a, __m256 b) {
  alignas(32) std::uint32_t bits[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits), _mm256_castps_si256(a));
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits + 8), _mm256_castps_si256(b));
  std::uint32_t kinds = 0;
  for (std::uint32_t word : bits) kinds |= nonfinite_kind(word);
  return kinds;
}

template <typename Src, typename Dst>
std::uint32_t Kernels::scale(const Src* src, Dst* dst, std::int64_t n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  std::uint32_t kinds = 0;
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = Vec8<Src>::load(src + i);
    const __m256 b = Vec8<Src>::load(src + i + 8);
    // A test and a branch never taken on a clean step, in place of the OR into an
    // accumulator it replaces: inf is told from nan only where one was seen.
    const __m256i nonfinite = _mm256_or_si256(nonfinite_lanes(a), nonfinite_lanes(b));
    if (__builtin_expect(!_mm256_testz_si256(nonfinite, nonfinite), 0)) kinds |= lane_kinds(a, b);
    Vec8<Dst>::store(dst + i, _mm256_mul_ps(a, f));
    Vec8<Dst>::store(dst + i + 8, _mm256_mul_ps(b, f));
  }
  for (; i < n; ++i) {
    const float x = Element<Src>::load(src[i]);
    kinds |= nonfinite_kind(float_to_bits(x));
    dst[i] = Element<Dst>::store(x * factor);
  }
  return kinds;
}

template <typename Storage>
double Kernels::sum_of_squares(const Storage* data, std::int64_t n) {
  static_assert(kSquareLanes == 16, "two registers of eight lanes");
  // Double lanes 0-3, 4-7, 8-11 and 12-15.
  __m256d totals[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                       _mm256_setzero_pd()};
  const std::int64_t whole = n - n % kSquareFold;
  for (std::int64_t start = 0; start < whole; start += kSquareFold) {
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (std::int64_t i = start; i < start + kSquareFold; i += 16) {
      const __m256 a = Vec8<Storage>::load(data + i);
      const __m256 b = Vec8<Storage>::load(data + i + 8);
      low = _mm256_add_ps(low, _mm256_mul_ps(a, a));
      high = _mm256_add_ps(high, _mm256_mul_ps(b, b));
    }
    totals[0] = _mm256_add_pd(totals[0], _mm256_cvtps_pd(_mm256_castps256_ps128(low)));
    totals[1] = _mm256_add_pd(totals[1], _mm256_cvtps_pd(_mm256_extractf128_ps(low, 1)));
    totals[2] = _mm256_add_pd(totals[2], _mm256_cvtps_pd(_mm256_castps256_ps128(high)));
    totals[3] = _mm256_add_pd(totals[3], _mm256_cvtps_pd(_mm256_extractf128_ps(high, 1)));
  }
  double lanes[kSquareLanes];
  for (int r = 0; r < 4; ++r) _mm256_storeu_pd(lanes + 4 * r, totals[r]);
  return finish_sum_of_squares(lanes, data, whole, n);
}

}  // namespace

std::uint32_t scale(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                    float factor) {
  return scale_any<Kernels>(src, src_dtype, dst, dst_dtype, n, factor);
}

double sum_of_squares(const void* data, DType dtype, std::int64_t n) {
  return sum_of_squares_any<Kernels>(data, dtype, n);
}

}  // namespace ampfuse::kernels::cpu::avx2

#endif
