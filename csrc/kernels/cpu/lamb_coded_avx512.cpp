// The fused LAMB passes over 8-bit coded moments of lamb_coded_avx2.cpp, sixteen lanes at a time
// for processors with AVX-512 (lamb_coded_kernels.cpp picks them first): the same loops
// (lamb_coded_lanes.inc), the same codes (coded_lanes_avx512.h), the same bits
// (tests/cpp/test_coded_lamb.cpp compares all three implementations).
#include "lamb_coded.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <algorithm>

#include "bf16_span.h"
#include "coded_lanes_avx512.h"
#include "lamb_lanes.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu::avx512 {

template <typename Storage>
using StorageLanes = Lanes512<Storage>;
typedef Avx512Words Words;

#define AMPFUSE_CODED_TARGET AMPFUSE_AVX512_TARGET
#include "lamb_coded_lanes.inc"
#undef AMPFUSE_CODED_TARGET

}  // namespace ampfuse::kernels::cpu::avx512

#endif
