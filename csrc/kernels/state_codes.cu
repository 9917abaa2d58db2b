// The CUDA conversions of state_codes_cuda.h: one CTA of 256 threads per block of 256 codes, so
// a block's absmax is one CTA reduction and no block spans two CTAs.
#include <cuda_runtime.h>

#include <type_traits>

#include "launch_check.cuh"
#include "state_codes_cuda.h"

namespace ampfuse::kernels::cuda {
namespace {

static_assert(kStateBlock == 256, "one thread per element of a block, eight warps");
constexpr int kWarps = kStateBlock / 32;

// The larger of two magnitudes, a nan winning whichever side it is on (fmaxf would drop it):
// encode_block's rule, so a nan anywhere in a block makes its scale nan. Which of several nans
// the tree keeps is not encode_block's (the last one); a scale's nan bits are not part of the
// contract, and the tests let a nan equal any nan.
__device__ __forceinline__ float max_keeping_nan(float a, float b) {
  return (b > a || b != b) ? b : a;
}

template <StateCode kCode, bool kSecond>
__global__ void decode_kernel(const std::uint8_t* __restrict__ codes,
                              const float* __restrict__ scales, float* __restrict__ moment,
                              std::int64_t numel) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kStateBlock + threadIdx.x;
  if (i < numel) moment[i] = decode_moment<kCode, kSecond>(codes[i], scales[blockIdx.x]);
}

template <StateCode kCode, bool kSecond>
__global__ void encode_kernel(const float* __restrict__ moment, std::uint8_t* __restrict__ codes,
                              float* __restrict__ scales, std::int64_t numel,
                              const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  __shared__ float warp_max[kWarps];
  __shared__ float block_max;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kStateBlock + threadIdx.x;
  const bool inside = i < numel;
  const float value = inside ? coded_value<kSecond>(moment[i]) : 0.0f;
  float m = fabsf(value);  // 0 past a short last block: |x| >= 0 leaves the max as it is
  for (int offset = 16; offset > 0; offset >>= 1) {
    m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kWarps ? warp_max[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      m = max_keeping_nan(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (threadIdx.x == 0) block_max = m;
  }
  __syncthreads();
  const float absmax = block_max;
  if (inside) codes[i] = encode_moment<kCode, kSecond>(value, absmax);
  if (threadIdx.x == 0) scales[blockIdx.x] = absmax;
}

// f(code constant, second constant) for the runtime pair.
template <typename F>
void with_code(StateCode code, bool second, F&& f) {
  const auto pick = [&](auto code_constant) {
    if (second) {
      f(code_constant, std::true_type{});
    } else {
      f(code_constant, std::false_type{});
    }
  };
  if (code == StateCode::kFp8) {
    pick(std::integral_constant<StateCode, StateCode::kFp8>{});
  } else {
    pick(std::integral_constant<StateCode, StateCode::kInt8>{});
  }
}

unsigned int block_count(std::int64_t numel) {
  return static_cast<unsigned int>((numel + kStateBlock - 1) / kStateBlock);
}

}  // namespace

void decode_moment_blocks(const std::uint8_t* codes, const float* scales, float* moment,
                          std::int64_t numel, StateCode code, bool second, StreamHandle stream) {
  if (numel == 0) return;
  with_code(code, second, [&](auto c, auto s) {
    decode_kernel<decltype(c)::value, decltype(s)::value>
        <<<block_count(numel), kStateBlock, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
            codes, scales, moment, numel);
  });
  throw_on_launch_error("decode_moment_blocks");
}

void encode_moment_blocks(const float* moment, std::uint8_t* codes, float* scales,
                          std::int64_t numel, StateCode code, bool second, const float* found_inf,
                          StreamHandle stream) {
  if (numel == 0) return;
  with_code(code, second, [&](auto c, auto s) {
    encode_kernel<decltype(c)::value, decltype(s)::value>
        <<<block_count(numel), kStateBlock, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
            moment, codes, scales, numel, found_inf);
  });
  throw_on_launch_error("encode_moment_blocks");
}

}  // namespace ampfuse::kernels::cuda
