// fp8_tensor_scale on CUDA: current scaling's amax and scale without a host sync. Two launches:
// a grid-wide amax reduction (16-byte loads, each block's max folded into *amax with an
// integer atomicMax on abs_bits, which orders like the floats with nan above inf) and a
// one-thread launch that applies current_fp8_scale (fp8_math.h), the CPU's rule, bit for bit.
// A single launch would need a grid-wide "last block" counter, itself zeroed by a launch.
#include <cuda_runtime.h>

#include <algorithm>

#include "fp8_cuda.h"
#include "fp8_vector_io.cuh"
#include "launch_check.cuh"

namespace ampfuse::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times over; more would only add atomics.
constexpr std::int64_t kMaxBlocks = 2048;

// Each thread reads whole 16-byte vectors, vector v at v * 16 bytes: consecutive threads read
// consecutive 16 bytes, so every load instruction of a warp covers 512 contiguous bytes.
// Elements past the last whole vector (and every element when src is not 16-byte aligned)
// are read one at a time.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* src, std::int64_t n, float* amax) {
  constexpr int kE = kElemsPer16B<T>;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t vectors = aligned_16(src) ? n / kE : 0;
  std::uint32_t largest = 0;
#pragma unroll 4
  for (std::int64_t v = first; v < vectors; v += stride) {
    float x[kE];
    load_16b(src + v * kE, x);
#pragma unroll
    for (int e = 0; e < kE; ++e) largest = max(largest, abs_bits(x[e]));
  }
  for (std::int64_t i = vectors * kE + first; i < n; i += stride) {
    largest = max(largest, abs_bits(to_float(src[i])));
  }
  largest = block_max_bits(largest);
  if (threadIdx.x == 0 && largest != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), largest);
}

__global__ void scale_from_amax_kernel(const float* amax, float* scale, float* scale_inv,
                                       float fp8_max, float margin_factor) {
  if (threadIdx.x != 0) return;
  const float s = current_fp8_scale(*amax, fp8_max, margin_factor);
  *scale = s;
  *scale_inv = fp8_detail::div_rn(1.0f, s);
}

template <typename T>
void launch_amax(const T* src, std::int64_t n, float* amax, cudaStream_t stream) {
  const std::int64_t per_block = std::int64_t{kThreads} * kElemsPer16B<T> * 4;
  const auto blocks = static_cast<unsigned>(
      std::clamp<std::int64_t>((n + per_block - 1) / per_block, 1, kMaxBlocks));
  amax_kernel<<<blocks, kThreads, 0, stream>>>(src, n, amax);
}

}  // namespace

void fp8_tensor_scale(const TensorRef& src, float* amax, float* scale, float* scale_inv,
                      float fp8_max, float margin_factor, StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(amax, 0, sizeof(float), s) != cudaSuccess)
    throw_on_launch_error("fp8_tensor_scale");
  if (src.numel > 0) {
    switch (src.dtype) {
      case DType::kFloat32:
        launch_amax(static_cast<const float*>(src.data), src.numel, amax, s);
        break;
      case DType::kFloat16:
        launch_amax(static_cast<const __half*>(src.data), src.numel, amax, s);
        break;
      case DType::kBFloat16:
        launch_amax(static_cast<const __nv_bfloat16*>(src.data), src.numel, amax, s);
        break;
    }
    throw_on_launch_error("fp8_tensor_scale (amax)");
  }
  scale_from_amax_kernel<<<1, 32, 0, s>>>(amax, scale, scale_inv, fp8_max, margin_factor);
  throw_on_launch_error("fp8_tensor_scale (scale)");
}

}  // namespace ampfuse::kernels::cuda
