// The fused coded Adam step of adam_coded_avx2.cpp, sixteen lanes at a time for processors with
// AVX-512 (adam_coded_kernels.cpp picks it first): the same loops (adam_coded_lanes.inc;
// adam_lanes and adam_bf16_lanes at their sixteen-lane width), the same codes
// (coded_lanes_avx512.h), the same bits as the AVX2 and the portable step
// (tests/cpp/test_coded_adam.cpp compares all three).
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "bf16_variants.h"
#include "coded_lanes_avx512.h"
#include "coded_moments.h"

namespace ampfuse::kernels::cpu::avx512 {

template <typename Storage>
using StorageLanes = Lanes512<Storage>;
typedef Avx512Words Words;

#define AMPFUSE_CODED_TARGET AMPFUSE_AVX512_TARGET
#include "adam_coded_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx512

#endif
