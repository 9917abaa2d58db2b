// Block-coded moments (state_codes.h) to fp32 and back over a CPU span: what fused_lamb_coded_
// (csrc/ops/lamb_coded.cpp) runs around the fp32 LAMB span kernels and the portable coded Adam
// step around its fp32 span kernels, in stack-free loops built with the kernels' flags (-O3, no
// FMA contraction).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../state_codes.h"

namespace ampfuse::kernels::cpu {

// Calls f(code, second) with both as compile-time constants (std::integral_constant), for the
// span loops' templates.
template <typename F>
void with_moment_code(StateCode code, bool second, F&& f) {
  using Int8 = std::integral_constant<StateCode, StateCode::kInt8>;
  using Fp8 = std::integral_constant<StateCode, StateCode::kFp8>;
  if (code == StateCode::kFp8) {
    second ? f(Fp8{}, std::true_type{}) : f(Fp8{}, std::false_type{});
  } else {
    second ? f(Int8{}, std::true_type{}) : f(Int8{}, std::false_type{});
  }
}

// Elements [first, first + n) of one param's moment: `codes` and `scales` are the whole
// param's (first must be a multiple of kStateBlock; the span then holds whole blocks, the last
// of the param possibly short). decode writes moment[0, n); encode codes moment[0, n) back,
// block by block as encode_block does.
// Each picks the loops of avx512:: where the processor has AVX-512, else those of avx2_fma::
// where it has AVX2, FMA and F16C, else portable::.
void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment);
void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales);

// The two implementations, both giving state_codes.h's bits (the tests run both): loops GCC
// vectorizes for any x86-64 (coded_moments.cpp), and AVX2+FMA loops that form each quotient
// without a division (coded_moments_avx2.cpp; coded_lanes_avx2.h says why that is exact).
namespace portable {
void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment);
void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales);
}  // namespace portable

#if defined(__x86_64__) && defined(__GNUC__)
#define AMPFUSE_HAVE_CODED_AVX2_FMA 1
namespace avx2_fma {
bool supported();  // the processor has AVX2, FMA and F16C; call the functions below only then
void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment);
void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales);
// x[i] / divisor by the division-free sequence the loops above use (for the tests).
void quotients(const float* x, std::int64_t n, float divisor, float* out);
}  // namespace avx2_fma
// The same loops sixteen lanes a vector (coded_moments_avx512.cpp), picked before avx2_fma::.
// Call them only where cpu_has_avx512() (lanes_avx512.h).
namespace avx512 {
void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment);
void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales);
void quotients(const float* x, std::int64_t n, float divisor, float* out);
}  // namespace avx512
#endif

}  // namespace ampfuse::kernels::cpu
