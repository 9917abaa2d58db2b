// FP8 cast + amax in one pass, and the multi-tensor delayed-scaling update: the element
// arithmetic is fp8_math.h's, shared with the CPU kernels bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"
#include "launch_check.cuh"

namespace ampfuse::kernels::cuda {
namespace {

constexpr int kCastThreads = 256;
constexpr int kCastUnroll = 4;
// Enough blocks to fill any current GPU several times over; more would only add atomics.
constexpr std::int64_t kMaxCastBlocks = 4096;

__device__ __forceinline__ float load_float(const float* p, std::int64_t i) { return p[i]; }
__device__ __forceinline__ float load_float(const __half* p, std::int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ float load_float(const __nv_bfloat16* p, std::int64_t i) {
  return __bfloat162float(p[i]);
}

template <Fp8Format kFormat, typename T>
__global__ void __launch_bounds__(kCastThreads)
    cast_amax_kernel(const T* src, std::uint8_t* dst, std::int64_t n, const float* scale_ptr,
                     float* amax) {
  const float scale = *scale_ptr;
  std::uint32_t largest = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kCastThreads;
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kCastThreads + threadIdx.x;
  // Unrolled so that each thread keeps several independent loads in flight; neighbouring
  // threads touch neighbouring elements, so loads and byte stores coalesce.
  for (; i + (kCastUnroll - 1) * stride < n; i += kCastUnroll * stride) {
    float x[kCastUnroll];
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) x[u] = load_float(src, i + u * stride);
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      largest = max(largest, abs_bits(x[u]));
      dst[i + u * stride] = scale_to_fp8<kFormat>(x[u], scale);
    }
  }
  for (; i < n; i += stride) {
    const float x = load_float(src, i);
    largest = max(largest, abs_bits(x));
    dst[i] = scale_to_fp8<kFormat>(x, scale);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __shared__ std::uint32_t warp_max[kCastThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = largest;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kCastThreads / 32; ++w) largest = max(largest, warp_max[w]);
    // abs_bits orders values as unsigned integers (nan above inf), so an integer max on
    // the float's bits is the nan-propagating float max. Blocks race; the max is the same
    // whatever the order.
    atomicMax(reinterpret_cast<unsigned int*>(amax), largest);
  }
}

template <Fp8Format kFormat>
void launch_cast(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                 cudaStream_t stream) {
  const std::int64_t per_block = std::int64_t{kCastThreads} * kCastUnroll;
  const auto blocks = static_cast<unsigned>(
      std::clamp<std::int64_t>((src.numel + per_block - 1) / per_block, 1, kMaxCastBlocks));
  switch (src.dtype) {
    case DType::kFloat32:
      cast_amax_kernel<kFormat><<<blocks, kCastThreads, 0, stream>>>(
          static_cast<const float*>(src.data), dst, src.numel, scale, amax);
      break;
    case DType::kFloat16:
      cast_amax_kernel<kFormat><<<blocks, kCastThreads, 0, stream>>>(
          static_cast<const __half*>(src.data), dst, src.numel, scale, amax);
      break;
    case DType::kBFloat16:
      cast_amax_kernel<kFormat><<<blocks, kCastThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(src.data), dst, src.numel, scale, amax);
      break;
  }
}

// States per launch: the table stays under the classic 4 KB of kernel parameters, so this
// launch needs no particular driver; a step with more FP8 tensors takes a few launches.
constexpr int kFp8StatesPerLaunch = 64;

struct Fp8StateTable {
  Fp8ScaleState states[kFp8StatesPerLaunch];
  int count;
};

// One thread per tensor: a history is short (a few hundred floats at most in practice) and
// the whole update is latency, not bandwidth.
__global__ void update_scales_kernel(Fp8StateTable table, float margin_factor, bool use_max,
                                     const float* skip) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= table.count) return;
  const bool skipped = skip != nullptr && *skip != 0.0f;
  update_fp8_scale(table.states[t], margin_factor, use_max, skipped);
}

}  // namespace

void fp8_cast_amax(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                   Fp8Format format, StreamHandle stream) {
  if (src.numel == 0) return;
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (format == Fp8Format::kE4M3) {
    launch_cast<Fp8Format::kE4M3>(src, dst, scale, amax, s);
  } else {
    launch_cast<Fp8Format::kE5M2>(src, dst, scale, amax, s);
  }
  throw_on_launch_error("fp8_cast_amax");
}

void fp8_update_scales(const std::vector<Fp8ScaleState>& states, float margin_factor,
                       bool use_max, const float* skip, StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  for (std::size_t first = 0; first < states.size(); first += kFp8StatesPerLaunch) {
    Fp8StateTable table{};
    table.count = static_cast<int>(
        std::min<std::size_t>(kFp8StatesPerLaunch, states.size() - first));
    std::copy_n(states.begin() + static_cast<std::ptrdiff_t>(first), table.count, table.states);
    update_scales_kernel<<<1, kFp8StatesPerLaunch, 0, s>>>(table, margin_factor, use_max, skip);
    throw_on_launch_error("fp8_update_scales_");
  }
}

int compute_capability(int device) {
  int major = 0;
  int minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    throw std::runtime_error("ampfuse: could not read the compute capability of CUDA device " +
                             std::to_string(device) + ": " +
                             cudaGetErrorString(cudaGetLastError()));
  }
  return major * 10 + minor;
}

}  // namespace ampfuse::kernels::cuda
