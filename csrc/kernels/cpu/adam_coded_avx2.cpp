// The CPU Adam step with 8-bit block-coded moments fused into one pass per block, for processors
// with AVX2, FMA and F16C (adam_coded_kernels.cpp picks it where AVX-512 is missing; elsewhere
// the step decodes a block into fp32, runs adam_span on it and codes it again).
//
// The step runs the very loops of the fp32-moment kernels (adam_lanes, adam_bf16_lanes) with a
// moment holder, BlockMoments, that decodes the elements of each moment into lanes as the loop
// loads them, and takes the updated lanes as it stores them: the first moment and the update's
// own sqrt(v) (the second moment's coded value) go to a block buffer while their absmax is kept
// in a register. The block is then coded from the buffers. Against decode -> adam_span -> encode
// this leaves out one pass over the block per moment, the fp32 moment stores and loads between
// them, and the second square root of v. The codes are coded_lanes_avx2.h's, so the result is
// the same bits as the unfused step (the Python tests compare the two on this processor, and
// both with the plain-torch reference). The loops are adam_coded_lanes.inc's, shared with the
// sixteen-lane AVX-512 step (adam_coded_avx512.cpp).
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "bf16_variants.h"
#include "coded_lanes_avx2.h"
#include "coded_moments.h"

namespace ampfuse::kernels::cpu::avx2_fma {

template <typename Storage>
using StorageLanes = avx2::F16cLanes<Storage>;
typedef Avx2Words Words;

// The loops' own target. BlockMoments' members carry it too, without always_inline: the
// loops (adam_lanes) that call them are target-free templates, inlined into adam_blocks, and GCC
// refuses to force a target-specific function into a target-free one (as F16cLanes, they
// inline once the loop sits in an AVX2 function).
#define AMPFUSE_CODED_TARGET __attribute__((target("avx2,fma,f16c")))
#include "adam_coded_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx2_fma

#endif
