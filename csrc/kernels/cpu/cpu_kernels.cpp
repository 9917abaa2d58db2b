// CPU span kernels. Loops are branch-free over fixed-width blocks so that the
// compiler vectorizes them; each hot function is also cloned for AVX2 and the
// best clone is picked when the library loads.
#include "cpu_kernels.h"

#include "half_convert.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

// Elements per inner block: one AVX2 register of floats, twice, so the flag and
// accumulator reductions stay out of the per-element work.
constexpr std::int64_t kBlock = 16;

template <typename Storage>
AMPFUSE_CPU_CLONES bool unscale_typed(Storage* data, std::int64_t n, float inv_scale) {
  std::uint32_t nonfinite = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = Element<Storage>::load(data[i]);
    nonfinite |= static_cast<std::uint32_t>(is_nonfinite(x));
    data[i] = Element<Storage>::store(x * inv_scale);
  }
  return nonfinite != 0;
}

template <typename Src, typename Dst>
AMPFUSE_CPU_CLONES bool scale_typed(const Src* src, Dst* dst, std::int64_t n, float scale) {
  std::uint32_t nonfinite = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = Element<Src>::load(src[i]);
    nonfinite |= static_cast<std::uint32_t>(is_nonfinite(x));
    dst[i] = Element<Dst>::store(x * scale);
  }
  return nonfinite != 0;
}

template <typename Storage>
AMPFUSE_CPU_CLONES double sum_of_squares_typed(const Storage* data, std::int64_t n) {
  // kBlock fp32 lanes keep the vector units busy; every kFold elements the lanes
  // are folded into double accumulators, so no fp32 sum ever holds more than
  // kFold / kBlock squares and the result stays within ~1e-7 of float64.
  constexpr std::int64_t kFold = 256;
  double totals[kBlock] = {};
  const std::int64_t whole = n - n % kFold;
  for (std::int64_t start = 0; start < whole; start += kFold) {
    float lanes[kBlock] = {};
    for (std::int64_t i = start; i < start + kFold; i += kBlock) {
      for (std::int64_t k = 0; k < kBlock; ++k) {
        const float x = Element<Storage>::load(data[i + k]);
        lanes[k] += x * x;
      }
    }
    for (std::int64_t k = 0; k < kBlock; ++k) totals[k] += lanes[k];
  }
  double total = 0.0;
  for (std::int64_t k = 0; k < kBlock; ++k) total += totals[k];
  for (std::int64_t i = whole; i < n; ++i) {
    const double x = Element<Storage>::load(data[i]);
    total += x * x;
  }
  return total;
}

}  // namespace

bool unscale_span(void* data, DType dtype, std::int64_t n, float inv_scale) {
  return with_storage(dtype, data, [&](auto* typed) { return unscale_typed(typed, n, inv_scale); });
}

bool scale_span(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                float scale) {
  return with_storage(src_dtype, const_cast<void*>(src), [&](auto* typed_src) {
    return with_storage(dst_dtype, dst, [&](auto* typed_dst) {
      return scale_typed(typed_src, typed_dst, n, scale);
    });
  });
}

double sum_of_squares_span(const void* data, DType dtype, std::int64_t n) {
  return with_storage(dtype, const_cast<void*>(data),
                      [&](auto* typed) { return sum_of_squares_typed(typed, n); });
}

}  // namespace ampfuse::kernels::cpu
