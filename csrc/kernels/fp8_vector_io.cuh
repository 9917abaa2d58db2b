// Device helpers shared by the FP8 CUDA kernels: 16-byte vector loads of fp32/fp16/bf16
// converted to fp32, packed stores of fp8 codes, one-element loads for tails, and the block
// max of abs_bits values (the nan-winning amax).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_math.h"

namespace ampfuse::kernels::cuda {

// Elements of T in one 16-byte load: 4 fp32 or 8 fp16/bf16.
template <typename T>
constexpr int kElemsPer16B = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
// bf16 -> fp32 is exact: the bf16 bits are the fp32's upper half.
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __uint_as_float(static_cast<std::uint32_t>(__bfloat16_as_ushort(x)) << 16);
}

// x[0..kElemsPer16B<T>) = the elements at p, which is 16-byte aligned: one 16-byte load.
template <typename T>
__device__ __forceinline__ void load_16b(const T* p, float* x) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  if constexpr (sizeof(T) == 4) {
    x[0] = __uint_as_float(v.x);
    x[1] = __uint_as_float(v.y);
    x[2] = __uint_as_float(v.z);
    x[3] = __uint_as_float(v.w);
  } else {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_float(e[i]);
  }
}

// Stores n (4, 8 or 16) codes at p, which is n-byte aligned, as one store of n bytes.
template <int kN>
__device__ __forceinline__ void store_codes(std::uint8_t* p, const std::uint8_t* c) {
  std::uint32_t w[kN / 4];
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) {
    w[i] = c[4 * i] | (c[4 * i + 1] << 8) | (c[4 * i + 2] << 16) |
           (static_cast<std::uint32_t>(c[4 * i + 3]) << 24);
  }
  if constexpr (kN == 4) {
    *reinterpret_cast<std::uint32_t*>(p) = w[0];
  } else if constexpr (kN == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Folds `bits` (an abs_bits value: a block's amax) into *amax the way the CPU ops fold, as
// max(abs_bits(*amax), bits). An integer atomicMax alone compares the old value's raw bits, so
// an amax that starts as -0.0 (a valid "amax >= 0", e.g. after amax.neg_() or a copy of -0.0)
// would win every fold (0x80000000 is above every abs_bits value) and the cast would never
// raise it; a negative nan (x86's default nan) would keep its sign. Each folding block clears
// the sign bit first: the first atomic on the word is a clear, a clear never sets a bit and
// every max is at most 0x7fffffff, so no max ever meets a set sign bit, whatever the blocks'
// order.
__device__ __forceinline__ void fold_amax_bits(float* amax, std::uint32_t bits) {
  auto* word = reinterpret_cast<unsigned int*>(amax);
  atomicAnd(word, 0x7fffffffu);
  atomicMax(word, bits);
}

// The fold of no element, for a cast of an empty tensor: max(abs_bits(*amax), 0) on the CPU,
// which clears a -0.0 or negative-nan amax's sign. One thread; static, so each file that
// launches it has its own.
static __global__ void fold_empty_amax_kernel(float* amax) { fold_amax_bits(amax, 0u); }

__device__ __forceinline__ bool aligned_16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// The max of every thread's `bits` in the block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread. abs_bits values order as their floats, nan above inf.
__device__ __forceinline__ std::uint32_t block_max_bits(std::uint32_t bits) {
  __shared__ std::uint32_t warp_max[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  }
  __syncthreads();  // warp_max may still be read by a previous call
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  bits = 0;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) bits = max(bits, warp_max[w]);
  return bits;
}

}  // namespace ampfuse::kernels::cuda
