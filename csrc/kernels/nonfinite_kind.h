// What a per-tensor overflow flag (the ops' optional `tensor_flags`) records, written once for
// the CPU and CUDA kernels: bit kHeldInf for a +-inf, bit kHeldNan for a nan. The kernels OR
// these into tensor_flags[i] for every tensor i that held such a value and never clear them.
#pragma once

#include <cstdint>

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

namespace ampfuse::kernels {

constexpr std::uint32_t kHeldInf = 1u;
constexpr std::uint32_t kHeldNan = 2u;

// kHeldInf, kHeldNan or 0 (finite) for the float whose bits are `bits`: the magnitude bits
// equal the exponent mask for an inf and exceed it for a nan, so the two compares add up to
// the kind without a branch (loops over it vectorize on the CPU).
AMPFUSE_HOST_DEVICE constexpr std::uint32_t nonfinite_kind(std::uint32_t bits) {
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  return static_cast<std::uint32_t>(magnitude >= 0x7f800000u) +
         static_cast<std::uint32_t>(magnitude > 0x7f800000u);
}

}  // namespace ampfuse::kernels
