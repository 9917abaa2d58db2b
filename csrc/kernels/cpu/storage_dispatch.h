// Shared by the CPU kernel files: runtime-dtype dispatch to typed loops, and
// the per-ISA function clones.
#pragma once

#include "../dtype.h"
#include "half_convert.h"

namespace ampfuse::kernels::cpu {

// Each hot loop is compiled twice, for AVX2 and for the baseline, and the loader
// picks the clone the processor supports. An x86-64-v4 (AVX-512) clone was
// measured and dropped: GCC 12's code for it ran fp16 Adam six times slower.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AMPFUSE_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define AMPFUSE_CPU_CLONES
#endif

// Calls f with a typed pointer for the runtime dtype.
template <typename F>
inline auto with_storage(DType dtype, void* data, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      return f(static_cast<Fp16Bits*>(data));
    case DType::kBFloat16:
      return f(static_cast<Bf16Bits*>(data));
    case DType::kFloat32:
    default:
      return f(static_cast<float*>(data));
  }
}

}  // namespace ampfuse::kernels::cpu
