// The span loops of coded_moments.h, cloned for AVX2 like the optimizer loops: decode_block's
// and encode_block's bits (state_codes.h), in loops GCC vectorizes (this file is built with
// -fno-trapping-math, see CMakeLists.txt).
#include "coded_moments.h"

#include <algorithm>
#include <cmath>

#include "lanes_avx512.h"
#include "storage_dispatch.h"

namespace ampfuse::kernels::cpu {
namespace {

// decode_block over each block of the span (its loop vectorizes in this file's flags).
template <StateCode kCode, bool kSecond>
AMPFUSE_CPU_CLONES void decode_blocks(const std::uint8_t* codes, const float* scales,
                                      std::int64_t n, float* moment) {
  for (std::int64_t start = 0; start < n; start += kStateBlock) {
    const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - start));
    decode_block<kCode, kSecond>(codes + start, size, scales[start / kStateBlock], moment + start);
  }
}

// encode_block's scale of a block whose coded values are `coded`: the largest |value|, or the
// last nan's |nan| when the block holds one (nothing compares above a nan, and each later nan
// replaces it). The largest is an integer max over the magnitudes' bits, which vectorizes: the
// order of the bits is the order of the values for non-negative floats, with every nan above
// inf, so a max beyond inf's bits says there is a nan, and only then is the block scanned for
// the last one.
inline float block_absmax(const float* coded, int n) {
  std::uint32_t largest = 0;
  for (int i = 0; i < n; ++i) {
    largest = std::max(largest, fp8_detail::bits_of(coded[i]) & 0x7fffffffu);
  }
  if (largest > 0x7f800000u) {
    for (int i = n - 1; i >= 0; --i) {
      if (coded[i] != coded[i]) return std::fabs(coded[i]);
    }
  }
  return fp8_detail::float_of(largest);
}

// encode_block over each block of the span, with each coded value (a sqrt for the second
// moment) formed once (coded_value is the identity for the first): the same coded_value, scale and
// encode_moment, in loops GCC vectorizes.
template <StateCode kCode, bool kSecond>
AMPFUSE_CPU_CLONES void encode_blocks(const float* moment, std::int64_t n, std::uint8_t* codes,
                                      float* scales) {
  float coded[kStateBlock];
  for (std::int64_t start = 0; start < n; start += kStateBlock) {
    const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - start));
    const float* values = moment + start;  // the first moment is coded as it is
    if constexpr (kSecond) {
      for (int i = 0; i < size; ++i) coded[i] = coded_value<kSecond>(values[i]);
      values = coded;
    }
    const float absmax = block_absmax(values, size);
    for (int i = 0; i < size; ++i) {
      codes[start + i] = encode_moment<kCode, kSecond>(values[i], absmax);
    }
    scales[start / kStateBlock] = absmax;
  }
}

}  // namespace

namespace portable {

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

}  // namespace portable

void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment) {
#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
  if (cpu_has_avx512()) {
    avx512::decode_moment_span(codes, scales, first, n, code, second, moment);
    return;
  }
  if (avx2_fma::supported()) {
    avx2_fma::decode_moment_span(codes, scales, first, n, code, second, moment);
    return;
  }
#endif
  portable::decode_moment_span(codes, scales, first, n, code, second, moment);
}

void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales) {
#ifdef AMPFUSE_HAVE_CODED_AVX2_FMA
  if (cpu_has_avx512()) {
    avx512::encode_moment_span(moment, first, n, code, second, codes, scales);
    return;
  }
  if (avx2_fma::supported()) {
    avx2_fma::encode_moment_span(moment, first, n, code, second, codes, scales);
    return;
  }
#endif
  portable::encode_moment_span(moment, first, n, code, second, codes, scales);
}

}  // namespace ampfuse::kernels::cpu
