// coded_moments_avx2.cpp's span loops sixteen elements a vector, for processors with AVX-512
// (coded_lanes_avx512.h): the same loops (coded_moments_lanes.inc), the same bits.
#include "coded_moments.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "coded_lanes_avx512.h"

namespace ampfuse::kernels::cpu::avx512 {

#define AMPFUSE_CODED_TARGET AMPFUSE_AVX512_TARGET
#include "coded_moments_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx512

#endif
