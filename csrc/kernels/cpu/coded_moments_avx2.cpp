// The coded-moment span loops of coded_moments.h for processors with AVX2 and FMA, eight
// elements a vector with coded_lanes_avx2.h (which says how they avoid the plain loops'
// per-element divisions and why that is exact). fused_lamb_coded_ runs them around its fp32
// LAMB span kernels; fused_adam_coded_ fuses the same lanes into its step
// (adam_coded_avx2.cpp).
#include "coded_moments.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "coded_lanes_avx2.h"

namespace ampfuse::kernels::cpu::avx2_fma {
namespace {

template <StateCode kCode, bool kSecond>
__attribute__((target("avx2,fma"))) void decode_blocks(const std::uint8_t* codes,
                                                       const float* scales, std::int64_t n,
                                                       float* moment) {
  for (std::int64_t start = 0; start < n; start += kStateBlock) {
    const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - start));
    const float scale = scales[start / kStateBlock];
    const __m256 scale8 = broadcast(scale);
    const int whole = size - size % 8;
    for (int i = 0; i < whole; i += 8) {
      _mm256_storeu_ps(moment + start + i, decode8<kCode, kSecond>(codes + start + i, scale8));
    }
    for (int i = whole; i < size; ++i) {
      moment[start + i] = decode_moment<kCode, kSecond>(codes[start + i], scale);
    }
  }
}

// --- coding: encode_moment's bits ---

template <StateCode kCode, bool kSecond>
__attribute__((target("avx2,fma"))) void encode_blocks(const float* moment, std::int64_t n,
                                                       std::uint8_t* codes, float* scales) {
  alignas(32) float roots[kStateBlock];
  for (std::int64_t start = 0; start < n; start += kStateBlock) {
    const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - start));
    const int whole = size - size % 8;
    const float* values = moment + start;  // the first moment is coded as it is
    if constexpr (kSecond) {
      for (int i = 0; i < whole; i += 8) {
        _mm256_store_ps(roots + i, _mm256_sqrt_ps(_mm256_loadu_ps(values + i)));
      }
      for (int i = whole; i < size; ++i) roots[i] = coded_value<true>(values[i]);
      values = roots;
    }
    __m256i largest = _mm256_setzero_si256();
    for (int i = 0; i < whole; i += 8) {
      largest = _mm256_max_epu32(largest, magnitude_bits(_mm256_loadu_ps(values + i)));
    }
    const float absmax = finish_absmax(largest, values, whole, size);
    scales[start / kStateBlock] = absmax;
    code_block<kCode, kSecond>(values, size, absmax, codes + start);
  }
}

}  // namespace

__attribute__((target("avx2,fma"))) void quotients(const float* x, std::int64_t n, float divisor,
                                                   float* out) {
  const __m256 divisor8 = broadcast(divisor);
  const __m256 reciprocal8 = broadcast(1.0f / divisor);
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    _mm256_storeu_ps(out + i, exact_quotient<true>(_mm256_loadu_ps(x + i), divisor8, reciprocal8));
  }
  for (std::int64_t i = whole; i < n; ++i) out[i] = x[i] / divisor;
}

bool supported() {
  // F16C too: the fused Adam step (adam_coded_avx2.cpp) moves fp16 and bf16 with it.
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment) {
  with_moment_code(code, second, [&](auto kind, auto is_second) {
    decode_blocks<kind(), is_second()>(codes + first, scales + first / kStateBlock, n, moment);
  });
}

void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales) {
  with_moment_code(code, second, [&](auto kind, auto is_second) {
    encode_blocks<kind(), is_second()>(moment, n, codes + first, scales + first / kStateBlock);
  });
}

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
