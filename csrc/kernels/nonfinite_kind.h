// What a per-tensor overflow flag (the ops' optional `tensor_flags`) records, written once for
// the CPU and CUDA kernels: bit kHeldInf for a +-inf, bit kHeldNan for a nan. The kernels OR
// these into tensor_flags[i] for every tensor i that held such a value and never clear them.
#pragma once

#include <cstdint>

#include "dtype.h"
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

// A test for inf/nan on a whole 32-bit word of packed elements (one fp32, or two fp16 or bf16
// lanes) in three integer operations, for the loops whose every element is checked. An element
// is inf or nan when its magnitude bits reach its exponent mask; adding (lowest bit of the
// exponent) to the magnitude then carries into the lane's sign bit, and nowhere else: the
// largest magnitude plus that bit still fits the lane. Only a word that tests positive needs
// nonfinite_kind on its elements to tell inf from nan.
struct NonfiniteWordTest {
  std::uint32_t magnitudes;  // every bit of each lane but its sign
  std::uint32_t carry;       // the lowest exponent bit of each lane
  std::uint32_t signs;       // the sign bit of each lane: where the carry lands
};

AMPFUSE_HOST_DEVICE constexpr NonfiniteWordTest nonfinite_word_test(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:  // exponent mask 0x7c00 per lane
      return {0x7fff7fffu, 0x04000400u, 0x80008000u};
    case DType::kBFloat16:  // exponent mask 0x7f80 per lane
      return {0x7fff7fffu, 0x00800080u, 0x80008000u};
    case DType::kFloat32:  // exponent mask 0x7f800000
    default:
      return {0x7fffffffu, 0x00800000u, 0x80000000u};
  }
}

// The sign bit of each lane of `word` that holds an inf or nan; 0 when every lane is finite.
AMPFUSE_HOST_DEVICE constexpr std::uint32_t nonfinite_lanes(std::uint32_t word,
                                                            NonfiniteWordTest test) {
  return ((word & test.magnitudes) + test.carry) & test.signs;
}

}  // namespace ampfuse::kernels
