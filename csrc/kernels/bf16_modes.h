// bf16 params updated without an fp32 master (master_weights="stochastic", "kahan" and "split"
// of every fused optimizer: FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB and FusedNovoGrad): how
// an update reads the value it starts from and writes its result back, written once for the CPU
// and CUDA kernels. Everything here is integer and bit work on fp32/bf16 patterns (no rounding
// mode of the FPU is involved), so both give the same bits.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "scale_rule.h"  // AMPFUSE_HOST_DEVICE

// Forced inline: the CPU loops vectorize only when these are inlined, and GCC's heuristics
// left the kahan store as a call.
#if defined(__CUDA_ARCH__)
#define AMPFUSE_BF16_INLINE __forceinline__
#elif defined(__GNUC__)
#define AMPFUSE_BF16_INLINE inline __attribute__((always_inline))
#else
#define AMPFUSE_BF16_INLINE inline
#endif

namespace ampfuse::kernels {

// What the master_params list of fused_adam_/fused_sgd_ holds. kFp32: fp32 masters, or an
// empty list for params updated directly and rounded to nearest (the modes that existed
// before the others). The others take bf16 params only.
enum class MasterMode : std::int32_t {
  kFp32 = 0,
  kStochastic = 1,  // no list; the param is rounded stochastically (no extra bytes)
  kKahan = 2,       // bf16 compensations: the rounding error carried into the next update
  kSplit = 3,       // the fp32 master's low 16 bits; the param is the master rounded to nearest
};

// How an optimizer op reads its master_params list: kFp32 for fp32 masters (or none when it is
// empty); a bf16 mode with the seed and, for kStochastic, each param's id in the rounding key
// (the list is then empty), or the compensations / low halves as bf16-sized bit patterns.
struct MasterListMode {
  MasterMode mode = MasterMode::kFp32;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> param_ids;
};

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(std::uint32_t, f);
#endif
}

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE float float_of(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

// cond ? a : b on bit patterns, with masks so that CPU loops stay branch-free and vectorize.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint32_t pick_bits(bool cond, std::uint32_t a,
                                                                std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE bool finite_bits(std::uint32_t u) {
  return (u & 0x7f800000u) != 0x7f800000u;
}

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE float widen_bf16(std::uint16_t h) {
  return float_of(static_cast<std::uint32_t>(h) << 16);
}

// Round to nearest even, NaN to the canonical 0x7fc0: c10::BFloat16's rounding, bit for bit.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint16_t bf16_nearest(float f) {
  const std::uint32_t u = bits_of(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(pick_bits((u & 0x7fffffffu) > 0x7f800000u, 0x7fc0u, rounded));
}

// Stochastic rounding with 16 random bits: the dropped low half is compared with a uniform
// random threshold by adding it, so |f| rounds away from zero with probability low / 2^16 and
// the rounded value is f on average. Values a bf16 holds exactly are unchanged. inf and NaN
// round to nearest (adding to their bits would turn inf into NaN).
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint16_t bf16_stochastic(float f,
                                                                      std::uint32_t random16) {
  const std::uint32_t u = bits_of(f);
  return static_cast<std::uint16_t>(
      pick_bits(finite_bits(u), (u + random16) >> 16, bf16_nearest(f)));
}

// Calls f(std::integral_constant<MasterMode, mode>) for a bf16 mode, so that each mode runs
// its own loop (a branch per call or CUDA block, never per element). kFp32 calls nothing: its
// kernels are the master/plain ones.
template <typename F>
AMPFUSE_HOST_DEVICE void with_bf16_mode(MasterMode mode, F&& f) {
  using M = MasterMode;
  switch (mode) {
    case M::kStochastic:
      f(std::integral_constant<M, M::kStochastic>{});
      break;
    case M::kKahan:
      f(std::integral_constant<M, M::kKahan>{});
      break;
    case M::kSplit:
      f(std::integral_constant<M, M::kSplit>{});
      break;
    case M::kFp32:
      break;
  }
}

// ---- counter-based random bits -------------------------------------------------------------
// The bits for element `index` of a param depend only on (seed, step, param id, index), never
// on thread, chunk or launch layout: a run is reproducible, resumes bit for bit from a
// checkpoint (the seed is a group option, the step and the param id are saved), and the CPU
// and CUDA kernels draw the same bits.

// splitmix64's finalizer: a bijection of 64-bit words with full avalanche.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A 32-bit bijection with low bias (Chris Wellons' "lowbias32" constants); 32-bit multiplies
// and shifts only, so a CPU loop over it vectorizes.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-param, per-step key, derived once per span (CPU) or chunk (CUDA).
struct RoundingKey {
  std::uint32_t lo;
  std::uint32_t hi;
};

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE RoundingKey rounding_key(std::uint64_t seed,
                                                                 float steps_taken,
                                                                 std::uint32_t param_id) {
  const auto step = static_cast<std::uint64_t>(steps_taken);
  const std::uint64_t k = mix64(mix64(seed) ^ ((step << 32) | param_id));
  return {static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(k >> 32)};
}

// The key of one 64K-element chunk (or CPU span) whose first element is `first_index`: chunks
// start at multiples of 64K, so every element of one shares the high word of its index, which
// is folded into the key here once instead of per element.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE RoundingKey chunk_key(const RoundingKey& key,
                                                              std::int64_t first_index) {
  return {key.lo,
          key.hi ^ static_cast<std::uint32_t>(static_cast<std::uint64_t>(first_index) >> 32)};
}

// 16 random bits for the element whose index has low word `index_lo`, under its chunk's key:
// two rounds of mix32 (with the key's two words), so neighbouring elements are uncorrelated.
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE std::uint32_t rounding_bits(const RoundingKey& chunk,
                                                                    std::uint32_t index_lo) {
  return mix32(mix32(index_lo ^ chunk.lo) ^ chunk.hi) >> 16;
}

// ---- reading and writing a bf16 param in each mode ------------------------------------------
// load() gives the fp32 value the update starts from; store() writes the updated value x back
// into the param and its extra array (the compensation or the low halves). `random16` is used
// by kStochastic only.

template <MasterMode kMode>
struct Bf16Param;

template <>
struct Bf16Param<MasterMode::kStochastic> {
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static float load(std::uint16_t param, std::uint16_t) {
    return widen_bf16(param);
  }
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static void store(float x, std::uint16_t& param,
                                                            std::uint16_t&,
                                                            std::uint32_t random16) {
    param = bf16_stochastic(x, random16);
  }
};

// The value is param + compensation: a pair of bf16s holds about 16 significant bits, so an
// update far below the param's resolution accumulates in the compensation until it moves the
// param. Both are rounded to nearest, so |compensation| <= half an ulp of the param. A
// non-finite param leaves a zero compensation (inf - inf would be NaN at the next load).
template <>
struct Bf16Param<MasterMode::kKahan> {
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static float load(std::uint16_t param,
                                                            std::uint16_t compensation) {
    return widen_bf16(param) + widen_bf16(compensation);
  }
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static void store(float x, std::uint16_t& param,
                                                            std::uint16_t& compensation,
                                                            std::uint32_t) {
    const std::uint16_t rounded = bf16_nearest(x);
    const float error = x - widen_bf16(rounded);
    param = rounded;
    compensation = static_cast<std::uint16_t>(
        pick_bits(finite_bits(static_cast<std::uint32_t>(rounded) << 16), bf16_nearest(error), 0u));
  }
};

// The param is the fp32 master rounded to nearest and the extra array the master's low 16 bits,
// read as the signed remainder (in fp32 bit steps) from the param: master bits =
// (param << 16) + sign_extend(low). Rounding the bit pattern up by half a bf16 step, (u + 0x8000)
// >> 16, moves the high half by exactly the borrow that sign_extend(low) takes back, so the
// pair holds every fp32 pattern exactly (inf included, and masters in [0x7f7f8000, 0x7f7fffff],
// which round to an inf param as they do under master_weights=True). Ties round away from zero:
// no 16-bit remainder can keep ties to even exact, because an even bf16 value is the nearest
// (ties to even) of 2^16 + 1 fp32 values. So the param equals master_weights=True's
// (bf16_nearest) except for a master exactly halfway above an even bf16 value. A NaN master
// gives the canonical NaN param, as bf16_nearest does; its low half keeps the master a NaN.
struct SplitHalves {
  std::uint16_t param;
  std::uint16_t low;
};

// In 16-bit halves: (u >> 16) plus the low half's top bit is (u + 0x8000) >> 16 mod 2^16, and
// the param minus that bit is the high half of (param << 16) + sign_extend(low).
AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE SplitHalves split_master(float x) {
  const std::uint32_t u = bits_of(x);
  const auto low = static_cast<std::uint16_t>(u);
  const auto rounded = static_cast<std::uint16_t>((u >> 16) + (low >> 15));
  // x != x: one unordered compare (no rounding involved, so both devices agree).
  const bool nan = x != x;
  return {static_cast<std::uint16_t>(pick_bits(nan, 0x7fc0u, rounded)), low};
}

AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE float join_master(std::uint16_t param, std::uint16_t low) {
  // (param << 16) + sign_extend(low), mod 2^32: a negative remainder borrows one from the param.
  const auto high = static_cast<std::uint16_t>(param - (low >> 15));
  return float_of((static_cast<std::uint32_t>(high) << 16) | low);
}

template <>
struct Bf16Param<MasterMode::kSplit> {
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static float load(std::uint16_t param,
                                                            std::uint16_t low) {
    return join_master(param, low);
  }
  AMPFUSE_HOST_DEVICE AMPFUSE_BF16_INLINE static void store(float x, std::uint16_t& param,
                                                            std::uint16_t& low, std::uint32_t) {
    const SplitHalves halves = split_master(x);
    param = halves.param;
    low = halves.low;
  }
};

}  // namespace ampfuse::kernels
