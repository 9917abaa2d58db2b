// Eight bf16 params of a master-free mode (bf16_modes.h's Bf16Param) to and from Lanes8: the
// same integer and bit work as the one-element load and store of bf16_span.h, on vectors of
// 32-bit words, so that the mode loops run their update on lanes as the fp32-master loops do
// (optimizer_variants.h). Each lane gives the bits the scalar functions give for its element
// (test_bf16_variants.cpp compares them on every high half with the low halves where
// rounding turns).
//
// Only moving 16-bit words in and out of 32-bit lanes differs between the two implementations
// (the `Words` policies below): software conversions anywhere (PortableWords), or one AVX2
// instruction each (Avx2Words), where GCC's generic conversions took three or four. The loops
// are bound by their arithmetic more than by memory (split's Adam op costs the same ratio to
// master_weights=True's with its data in L2 as from DRAM), and an Adam iteration waits on three
// divisions and a square root: every instruction it adds keeps fewer iterations in flight. With
// GCC's conversions split's Adam op took 1.26x True's time on 4M params, with these 1.0-1.1x
// (benchmarks/RESULTS.md, issue 33).
#pragma once

#include <cstdint>

#include "../bf16_modes.h"
#include "bf16_span.h"
#include "lanes8.h"
#include "vec_avx2.h"

namespace ampfuse::kernels::cpu {

typedef std::uint16_t Bf16Words8 __attribute__((vector_size(16)));
typedef std::int16_t SignedWords8 __attribute__((vector_size(16)));
typedef std::uint32_t Words8 __attribute__((vector_size(32)));
typedef std::uint32_t Words16 __attribute__((vector_size(64)));

// The lanes' bits as unsigned words and back, for eight lanes or sixteen (the AVX-512 coded
// Adam step's, adam_coded_avx512.cpp); the functions below take either width.
AMPFUSE_BF16_INLINE Words8 lane_bits(Lanes8 x) { return reinterpret_cast<Words8>(x.v); }
AMPFUSE_BF16_INLINE Words16 lane_bits(Lanes16 x) { return reinterpret_cast<Words16>(x.v); }

AMPFUSE_BF16_INLINE Lanes8 lanes_from_bits(Words8 u) { return reinterpret_cast<Float8>(u); }
AMPFUSE_BF16_INLINE Lanes16 lanes_from_bits(Words16 u) { return reinterpret_cast<Float16>(u); }

// A comparison's lane mask (all ones where it held) as unsigned words.
AMPFUSE_BF16_INLINE Words8 mask_of(Int8 comparison) { return reinterpret_cast<Words8>(comparison); }
AMPFUSE_BF16_INLINE Words16 mask_of(Int16 comparison) {
  return reinterpret_cast<Words16>(comparison);
}

// {0, 1, ..., W - 1}: each lane's offset from the vector's first element.
template <typename Words>
AMPFUSE_BF16_INLINE Words lane_offsets() {
  Words lane{};
  for (int k = 0; k < static_cast<int>(sizeof(Words) / 4); ++k) lane[k] = k;
  return lane;
}

// Eight 16-bit words widened with zeros or with their sign, and the low 16 bits of eight lanes
// stored. Lanes and Vec are the policy's lane and word vectors.
struct PortableWords {
  typedef Lanes8 Lanes;
  typedef Words8 Vec;
  static AMPFUSE_BF16_INLINE Words8 widen(const std::uint16_t* p) {
    Bf16Words8 h;
    __builtin_memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, Words8);
  }
  static AMPFUSE_BF16_INLINE Words8 widen_signed(const std::uint16_t* p) {
    SignedWords8 h;
    __builtin_memcpy(&h, p, sizeof h);
    return reinterpret_cast<Words8>(__builtin_convertvector(h, Int8));
  }
  static AMPFUSE_BF16_INLINE void store_low_halves(std::uint16_t* p, Words8 u) {
    const Bf16Words8 h = __builtin_convertvector(u, Bf16Words8);
    __builtin_memcpy(p, &h, sizeof h);
  }
};

#ifdef AMPFUSE_HAVE_AVX2_PATH
struct Avx2Words {
  typedef Lanes8 Lanes;
  typedef Words8 Vec;
  static AMPFUSE_AVX2 Words8 widen(const std::uint16_t* p) {
    return reinterpret_cast<Words8>(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static AMPFUSE_AVX2 Words8 widen_signed(const std::uint16_t* p) {
    return reinterpret_cast<Words8>(
        _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static AMPFUSE_AVX2 void store_low_halves(std::uint16_t* p, Words8 u) {
    // Bytes 0-1, 4-5, 8-9, 12-13 of each 128-bit half to its low 8 bytes, then the two halves'
    // low quadwords together.
    const __m256i gather =
        _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                         12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed =
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(reinterpret_cast<__m256i>(u), gather), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};
#endif

template <typename Words>
AMPFUSE_BF16_INLINE auto widen_bf16_lanes(Words h) {
  return lanes_from_bits(h << 16);
}

// bf16_nearest, in 32-bit lanes (each below 2^16).
template <typename Words>
AMPFUSE_BF16_INLINE Words bf16_nearest_lanes(Words u) {
  const Words rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const Words nan = mask_of((u & 0x7fffffffu) > 0x7f800000u);
  return (rounded & ~nan) | (0x7fc0u & nan);
}

template <typename Words>
AMPFUSE_BF16_INLINE Words finite_lane_mask(Words u) {
  return mask_of((u & 0x7f800000u) != 0x7f800000u);
}

template <typename Words>
AMPFUSE_BF16_INLINE Words mix32_lanes(Words x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Bf16ModeLanes<kMode, Words>::load(param, extra, i) and store(p, param, extra, i, key,
// first_lo) are load_bf16_param and store_bf16_param (bf16_span.h) for elements i..i+7.
template <MasterMode kMode, typename Words>
struct Bf16ModeLanes;

template <typename Words>
struct Bf16ModeLanes<MasterMode::kStochastic, Words> {
  typedef typename Words::Vec Vec;
  static AMPFUSE_BF16_INLINE typename Words::Lanes load(const std::uint16_t* __restrict param,
                                                        const std::uint16_t* __restrict,
                                                        std::int64_t i) {
    return widen_bf16_lanes(Words::widen(param + i));
  }
  static AMPFUSE_BF16_INLINE void store(typename Words::Lanes x, std::uint16_t* __restrict param,
                                        std::uint16_t* __restrict, std::int64_t i,
                                        const RoundingKey& key, std::uint32_t first_lo) {
    const Vec index_lo = lane_offsets<Vec>() + (first_lo + static_cast<std::uint32_t>(i));
    const Vec random16 = mix32_lanes(mix32_lanes(index_lo ^ key.lo) ^ key.hi) >> 16;
    const Vec u = lane_bits(x);
    const Vec finite = finite_lane_mask(u);
    Words::store_low_halves(param + i,
                            (((u + random16) >> 16) & finite) | (bf16_nearest_lanes(u) & ~finite));
  }
};

template <typename Words>
struct Bf16ModeLanes<MasterMode::kKahan, Words> {
  typedef typename Words::Vec Vec;
  static AMPFUSE_BF16_INLINE typename Words::Lanes load(
      const std::uint16_t* __restrict param, const std::uint16_t* __restrict compensation,
      std::int64_t i) {
    return widen_bf16_lanes(Words::widen(param + i)) +
           widen_bf16_lanes(Words::widen(compensation + i));
  }
  static AMPFUSE_BF16_INLINE void store(typename Words::Lanes x, std::uint16_t* __restrict param,
                                        std::uint16_t* __restrict compensation, std::int64_t i,
                                        const RoundingKey&, std::uint32_t) {
    const Vec rounded = bf16_nearest_lanes(lane_bits(x));
    const typename Words::Lanes error = x - lanes_from_bits(rounded << 16);
    Words::store_low_halves(param + i, rounded);
    Words::store_low_halves(compensation + i,
                            bf16_nearest_lanes(lane_bits(error)) & finite_lane_mask(rounded << 16));
  }
};

// join_master and split_master on lanes.
template <typename Words>
struct Bf16ModeLanes<MasterMode::kSplit, Words> {
  typedef typename Words::Vec Vec;
  // (param << 16) + sign_extend(low) mod 2^32, which join_master forms in 16-bit halves.
  static AMPFUSE_BF16_INLINE typename Words::Lanes load(const std::uint16_t* __restrict param,
                                                        const std::uint16_t* __restrict low,
                                                        std::int64_t i) {
    return lanes_from_bits((Words::widen(param + i) << 16) + Words::widen_signed(low + i));
  }
  static AMPFUSE_BF16_INLINE void store(typename Words::Lanes x, std::uint16_t* __restrict param,
                                        std::uint16_t* __restrict low, std::int64_t i,
                                        const RoundingKey&, std::uint32_t) {
    const Vec u = lane_bits(x);
    // (u + 0x8000) >> 16 is (u >> 16) + (the low half's top bit) mod 2^16, as split_master
    // forms it; x != x is its NaN test.
    const Vec nan = mask_of(x.v != x.v);
    Words::store_low_halves(param + i, (((u + 0x8000u) >> 16) & ~nan) | (0x7fc0u & nan));
    Words::store_low_halves(low + i, u);
  }
};

}  // namespace ampfuse::kernels::cpu
