// CPU fp8 cast + amax: one branch-free loop per (input dtype, fp8 format) that GCC
// vectorizes, with an AVX2 clone picked at load time like the other span kernels.
#include "fp8_kernels.h"

#include <algorithm>

#include "half_convert.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

template <Fp8Format kFormat, typename Storage>
AMPFUSE_CPU_CLONES std::uint32_t cast_amax(const Storage* src, std::uint8_t* dst, std::int64_t n,
                                           float scale) {
  std::uint32_t largest = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = Element<Storage>::load(src[i]);
    largest = std::max(largest, abs_bits(x));
    dst[i] = scale_to_fp8<kFormat>(x, scale);
  }
  return largest;
}

}  // namespace

std::uint32_t fp8_cast_amax_span(const void* src, DType src_dtype, std::uint8_t* dst,
                                 std::int64_t n, float scale, Fp8Format format) {
  return with_storage(src_dtype, const_cast<void*>(src), [&](auto* typed) {
    return format == Fp8Format::kE4M3 ? cast_amax<Fp8Format::kE4M3>(typed, dst, n, scale)
                                      : cast_amax<Fp8Format::kE5M2>(typed, dst, n, scale);
  });
}

}  // namespace ampfuse::kernels::cpu
