// The implementations behind each span function of cpu_kernels.h: portable loops that
// run on any CPU, and AVX2+F16C loops for x86 processors that have those instructions.
// cpu_kernels.cpp picks one per call; the tests run both and require the same bits.
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../nonfinite_kind.h"
#include "half_convert.h"
#include "storage_dispatch.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

// Sums of squares accumulate in kSquareLanes fp32 lanes (lane k takes elements k, k + 16,
// ...), folded into double lanes every kSquareFold elements and added up in lane order. Both
// implementations follow this order exactly, so they return the same double.
constexpr std::int64_t kSquareLanes = 16;
constexpr std::int64_t kSquareFold = 256;

// Both implementations take src == dst for unscaling in place, and return the kinds of
// non-finite src elements (kHeldInf | kHeldNan of nonfinite_kind.h).
namespace portable {
std::uint32_t scale(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                    float factor);
double sum_of_squares(const void* data, DType dtype, std::int64_t n);
}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
// Call only where cpu_has_avx2_f16c() is true.
namespace avx2 {
std::uint32_t scale(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                    float factor);
double sum_of_squares(const void* data, DType dtype, std::int64_t n);
}  // namespace avx2
#endif

// The end of a sum of squares, the same for both implementations: the double lanes added
// in lane order, then the elements after the last whole fold, squared in double.
template <typename Storage>
double finish_sum_of_squares(const double (&lanes)[kSquareLanes], const Storage* data,
                             std::int64_t whole, std::int64_t n) {
  double total = 0.0;
  for (double lane : lanes) total += lane;
  for (std::int64_t i = whole; i < n; ++i) {
    const double x = Element<Storage>::load(data[i]);
    total += x * x;
  }
  return total;
}

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::scale<Src, Dst>(src, dst, n, factor) and
// Kernels::sum_of_squares<Storage>(data, n).
template <typename Kernels>
std::uint32_t scale_any(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                        std::int64_t n, float factor) {
  return with_storage(src_dtype, const_cast<void*>(src), [&](auto* typed_src) {
    return with_storage(dst_dtype, dst, [&](auto* typed_dst) {
      return Kernels::scale(typed_src, typed_dst, n, factor);
    });
  });
}

template <typename Kernels>
double sum_of_squares_any(const void* data, DType dtype, std::int64_t n) {
  return with_storage(dtype, const_cast<void*>(data),
                      [&](auto* typed) { return Kernels::sum_of_squares(typed, n); });
}

}  // namespace ampfuse::kernels::cpu
