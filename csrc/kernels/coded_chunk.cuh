// What the CUDA kernels that step 8-bit block-coded moments in place share (adam_coded.cu,
// lamb_coded.cu): a chunk's codes and scales as the table holds them, the param read and written
// as fp32 through its master or its bf16 mode, and each code block's absmax formed by the 256
// threads that own its elements, one element each.
//
// One element per thread keeps a step's update within the list kernels' 64 registers: a warp
// per block held 8 elements of three moments per lane and spilled 500+ bytes a thread (ptxas,
// sm_90, Adam).
#pragma once

#include "optimizer_step.cuh"
#include "state_codes.h"

namespace ampfuse::kernels::cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerCodeBlock = kStateBlock / kWarp;
constexpr int kCodeBlocksAtOnce = kThreadsPerBlock / kStateBlock;  // code blocks a CTA works on
static_assert(kChunkSize % kStateBlock == 0, "a chunk holds whole code blocks");
static_assert(kThreadsPerBlock % kStateBlock == 0, "a CTA holds whole code blocks");

// The absmax of a coded value as bits: |x|'s bits order like its values, nan above inf, so
// an unsigned max keeps a nan, as encode_block's compare does. Which nan differs: this keeps
// the largest bits, encode_block the last one. The scale's nan bits are not part of the
// contract (tests/python/adam_coded_cases.py's assert_same_bits lets a nan equal any nan).
__device__ __forceinline__ std::uint32_t magnitude_bits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const std::uint32_t other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

// The param of a chunk read and written as fp32: its master when there is one, else itself.
template <typename Param>
struct PlainParam {
  Param* param;
  float* master;
  __device__ float load(int i) const {
    return master != nullptr ? master[i] : DeviceElement<Param>::load(param[i]);
  }
  __device__ void store(int i, float p) const {
    if (master != nullptr) master[i] = p;
    param[i] = DeviceElement<Param>::store(p);
  }
};

// A bf16 param without an fp32 master (bf16_modes.h), through Bf16Chunk.
template <MasterMode kMode>
struct ModeParam {
  Bf16Chunk<kMode> bf16;
  __device__ float load(int i) const {
    return bf16.value(bf16.param[i],
                      Bf16Chunk<kMode>::kStochastic ? std::uint16_t{0} : bf16.extra[i]);
  }
  __device__ void store(int i, float p) const {
    std::uint16_t param_bits, extra_bits;
    bf16.bits(p, i, param_bits, extra_bits);
    bf16.param[i] = param_bits;
    if constexpr (!Bf16Chunk<kMode>::kStochastic) bf16.extra[i] = extra_bits;
  }
};

template <int Depth>
__device__ std::uint8_t* code_list(const ChunkTable<Depth>& table, const BlockChunk& chunk, int d) {
  return static_cast<std::uint8_t*>(table.addresses[d][chunk.slot]) + chunk.start;
}

template <int Depth>
__device__ float* scale_list(const ChunkTable<Depth>& table, const BlockChunk& chunk, int d) {
  return static_cast<float*>(table.addresses[d][chunk.slot]) + chunk.start / kStateBlock;
}

// One moment of a chunk: its codes and scales at the chunk's start.
template <StateCode kCode, bool kSecond>
struct ChunkMoment {
  std::uint8_t* codes;
  float* scales;
  __device__ float decode(int i) const {
    return decode_moment<kCode, kSecond>(codes[i], scales[i / kStateBlock]);
  }
  __device__ void encode(int i, float value, float absmax) const {
    codes[i] = encode_moment<kCode, kSecond>(coded_value<kSecond>(value), absmax);
  }
};

// Each warp's maximum of each of K moments, two buffers: a round's maxima are read between its
// barrier and the next round's, while the next round writes the other buffer, so one barrier per
// round suffices. A kernel declares one (in its functor) for all the variants it instantiates:
// a __shared__ array inside a template would count once per variant toward the CTA's shared
// memory.
template <int K>
using WarpMaxima = std::uint32_t[2][kCodeBlocksAtOnce][kWarpsPerCodeBlock][K];

// The absmax of each of K coded values over the code block of the calling thread's element
// (element t of a round belongs to block t / kStateBlock of the round). `bits[k]` is the
// thread's magnitude_bits of value k, 0 for a thread that owns no element. Every thread of the
// CTA calls it, once per round, with `buffer` alternating between rounds. `maxima` may have
// room for more values than K (one buffer serves a kernel's variants).
template <int K, int kRoom>
__device__ __forceinline__ void code_block_absmax(const std::uint32_t (&bits)[K],
                                                  WarpMaxima<kRoom>& maxima, int buffer,
                                                  float (&absmax)[K]) {
  static_assert(K <= kRoom, "room for every value's maxima");
  const int t = static_cast<int>(threadIdx.x);
  const int group = t / kStateBlock;
  const int warp = t % kStateBlock / kWarp;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const std::uint32_t warp_bits = warp_max(bits[k]);
    if (t % kWarp == 0) maxima[buffer][group][warp][k] = warp_bits;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    std::uint32_t largest = 0;
#pragma unroll
    for (int w = 0; w < kWarpsPerCodeBlock; ++w) {
      const std::uint32_t b = maxima[buffer][group][w][k];
      largest = b > largest ? b : largest;
    }
    absmax[k] = __uint_as_float(largest);
  }
}

}  // namespace ampfuse::kernels::cuda
