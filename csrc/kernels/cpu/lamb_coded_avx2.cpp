// The fused LAMB passes over 8-bit coded moments (lamb_coded.h), eight lanes at a time for
// processors with AVX2, FMA and F16C: lamb_coded_lanes.inc's loops with F16C storage lanes and
// coded_lanes_avx2.h's codes. lamb_coded_kernels.cpp picks them where AVX-512 is missing.
#include "lamb_coded.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "bf16_span.h"
#include "coded_lanes_avx2.h"
#include "lamb_lanes.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu::avx2_fma {

template <typename Storage>
using StorageLanes = avx2::F16cLanes<Storage>;
typedef Avx2Words Words;

// As in adam_coded_avx2.cpp: the holder's members carry the target without always_inline.
#define AMPFUSE_CODED_TARGET __attribute__((target("avx2,fma,f16c")))
#include "lamb_coded_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
