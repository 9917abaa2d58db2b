// The coded-moment span loops of coded_moments.h for processors with AVX2 and FMA, eight
// elements a vector with coded_lanes_avx2.h (which says how they avoid the plain loops'
// per-element divisions and why that is exact). fused_lamb_coded_ runs them around its fp32
// LAMB span kernels; fused_adam_coded_ fuses the same lanes into its step
// (adam_coded_avx2.cpp). The loops are coded_moments_lanes.inc's, shared with the AVX-512 ones.
#include "coded_moments.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "coded_lanes_avx2.h"

namespace ampfuse::kernels::cpu::avx2_fma {

bool supported() {
  // F16C too: the fused Adam step (adam_coded_avx2.cpp) moves fp16 and bf16 with it.
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

#define AMPFUSE_CODED_TARGET __attribute__((target("avx2,fma")))
#include "coded_moments_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
