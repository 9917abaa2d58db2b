// FP8 cast + amax in one pass, and the multi-tensor delayed-scaling update: the element
// arithmetic is fp8_math.h's, shared with the CPU kernels bit for bit.
//
// The cast's access pattern: the input is cut into 16-byte vectors (4 fp32 or 8 fp16/bf16
// elements); vector v goes to thread v mod (threads in the grid), so one load instruction of a
// warp reads 32 consecutive vectors, 512 contiguous bytes, and the matching store writes their
// codes as 32 consecutive 4- or 8-byte words (128 or 256 contiguous bytes): every sector moved
// is whole, and each thread keeps kCastUnroll 16-byte loads in flight. This needs src 16-byte
// aligned and dst aligned to the code group (always, for tensors torch allocated); a view at
// an odd offset takes the element-per-thread kernel, whose byte stores still coalesce. The
// few elements past the last whole vector are cast one per thread.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"
#include "fp8_vector_io.cuh"
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
    fold_amax_bits(amax, largest);
  }
}

// The vector path (see the top of the file).
template <Fp8Format kFormat, typename T>
__global__ void __launch_bounds__(kCastThreads)
    cast_amax_vector_kernel(const T* src, std::uint8_t* dst, std::int64_t n, const float* scale_ptr,
                            float* amax) {
  constexpr int kE = kElemsPer16B<T>;
  const float scale = *scale_ptr;
  const std::int64_t vectors = n / kE;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kCastThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kCastThreads + threadIdx.x;
  std::uint32_t largest = 0;
  std::int64_t v = first;
  for (; v + (kCastUnroll - 1) * stride < vectors; v += kCastUnroll * stride) {
    float x[kCastUnroll][kE];
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) load_16b(src + (v + u * stride) * kE, x[u]);
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      std::uint8_t c[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        largest = max(largest, abs_bits(x[u][e]));
        c[e] = scale_to_fp8<kFormat>(x[u][e], scale);
      }
      store_codes<kE>(dst + (v + u * stride) * kE, c);
    }
  }
  for (; v < vectors; v += stride) {
    float x[kE];
    std::uint8_t c[kE];
    load_16b(src + v * kE, x);
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      largest = max(largest, abs_bits(x[e]));
      c[e] = scale_to_fp8<kFormat>(x[e], scale);
    }
    store_codes<kE>(dst + v * kE, c);
  }
  for (std::int64_t i = vectors * kE + first; i < n; i += stride) {
    const float x = to_float(src[i]);
    largest = max(largest, abs_bits(x));
    dst[i] = scale_to_fp8<kFormat>(x, scale);
  }
  largest = block_max_bits(largest);
  // Block 0 folds even a 0, so that the sign of a -0.0 amax is cleared as on the CPU.
  if (threadIdx.x == 0 && (largest != 0 || blockIdx.x == 0)) fold_amax_bits(amax, largest);
}

template <Fp8Format kFormat, typename T>
void launch_typed_cast(const T* src, std::uint8_t* dst, std::int64_t n, const float* scale,
                       float* amax, cudaStream_t stream) {
  constexpr int kE = kElemsPer16B<T>;
  const bool vector = (reinterpret_cast<std::uintptr_t>(src) & 15u) == 0 &&
                      (reinterpret_cast<std::uintptr_t>(dst) & (kE - 1)) == 0;
  const std::int64_t per_block = std::int64_t{kCastThreads} * kCastUnroll * (vector ? kE : 1);
  const auto blocks = static_cast<unsigned>(
      std::clamp<std::int64_t>((n + per_block - 1) / per_block, 1, kMaxCastBlocks));
  if (vector) {
    cast_amax_vector_kernel<kFormat><<<blocks, kCastThreads, 0, stream>>>(src, dst, n, scale, amax);
  } else {
    cast_amax_kernel<kFormat><<<blocks, kCastThreads, 0, stream>>>(src, dst, n, scale, amax);
  }
}

template <Fp8Format kFormat>
void launch_cast(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                 cudaStream_t stream) {
  switch (src.dtype) {
    case DType::kFloat32:
      launch_typed_cast<kFormat>(static_cast<const float*>(src.data), dst, src.numel, scale, amax,
                                 stream);
      break;
    case DType::kFloat16:
      launch_typed_cast<kFormat>(static_cast<const __half*>(src.data), dst, src.numel, scale, amax,
                                 stream);
      break;
    case DType::kBFloat16:
      launch_typed_cast<kFormat>(static_cast<const __nv_bfloat16*>(src.data), dst, src.numel, scale,
                                 amax, stream);
      break;
  }
}

// States per launch: kernel parameters may take up to 32 KB (CUDA 12.1+, Volta and newer, which
// covers every architecture ampfuse builds), so a step's whole state table (512 x 48 bytes)
// goes in one launch; a step with more FP8 tensors takes a launch per 512.
constexpr int kFp8StatesPerLaunch = 512;
constexpr int kUpdateThreads = 128;

struct Fp8StateTable {
  Fp8ScaleState states[kFp8StatesPerLaunch];
  int count;
};

// A block per tensor. The history moves one slot older in parallel: chunks of blockDim
// entries from the oldest end down, each thread reading its entry's newer neighbour, a barrier,
// then every thread writing. A chunk writes only entries above what the next (newer) chunk
// reads, and the next chunk's writes come after its own barrier, which every thread reaches
// only after this chunk's reads: no entry is overwritten before it was read. The block max of
// the entries read (and the step's amax) is the history's new max; thread 0 applies
// set_delayed_scale, the CPU's rule.
__global__ void __launch_bounds__(kUpdateThreads)
    update_scales_kernel(const __grid_constant__ Fp8StateTable table, float margin_factor,
                         bool use_max, const float* skip) {
  const Fp8ScaleState& s = table.states[blockIdx.x];
  const float step_amax = *s.amax;
  const bool skipped = skip != nullptr && *skip != 0.0f;
  std::uint32_t largest = abs_bits(step_amax);
  const bool roll = !skipped && s.history_len > 0;
  if (roll) {
    for (std::int64_t top = s.history_len; top > 1; top -= kUpdateThreads) {
      const std::int64_t i = top - 1 - threadIdx.x;
      float older = 0.0f;
      if (i >= 1) {
        older = s.history[i - 1];
        largest = max(largest, abs_bits(older));
      }
      __syncthreads();
      if (i >= 1) s.history[i] = older;
    }
  }
  largest = block_max_bits(largest);  // also the barrier before thread 0 writes *s.amax
  if (threadIdx.x != 0) return;
  if (roll) {
    s.history[0] = step_amax;
    set_delayed_scale(s, use_max ? fp8_detail::float_of(largest) : step_amax, margin_factor);
  }
  *s.amax = 0.0f;
  *s.scale_inv = fp8_detail::div_rn(1.0f, *s.scale);
}

}  // namespace

void fp8_cast_amax(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                   Fp8Format format, StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (src.numel == 0) {
    fold_empty_amax_kernel<<<1, 1, 0, s>>>(amax);
    throw_on_launch_error("fp8_cast_amax");
    return;
  }
  if (format == Fp8Format::kE4M3) {
    launch_cast<Fp8Format::kE4M3>(src, dst, scale, amax, s);
  } else {
    launch_cast<Fp8Format::kE5M2>(src, dst, scale, amax, s);
  }
  throw_on_launch_error("fp8_cast_amax");
}

void fp8_update_scales(const std::vector<Fp8ScaleState>& states, float margin_factor, bool use_max,
                       const float* skip, StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  for (std::size_t first = 0; first < states.size(); first += kFp8StatesPerLaunch) {
    static thread_local Fp8StateTable table;  // 24 KB: kept off the stack
    table.count =
        static_cast<int>(std::min<std::size_t>(kFp8StatesPerLaunch, states.size() - first));
    std::copy_n(states.begin() + static_cast<std::ptrdiff_t>(first), table.count, table.states);
    update_scales_kernel<<<table.count, kUpdateThreads, 0, s>>>(table, margin_factor, use_max,
                                                                skip);
    throw_on_launch_error("fp8_update_scales_");
  }
}

namespace {

int read_compute_capability(int device) {
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

// Device indices whose capability is remembered: more GPUs than any one node has. A device
// past it (or a bad index, which read_compute_capability refuses) is asked every time.
constexpr int kRememberedDevices = 64;
// 0: not read yet (no real device has capability 0). Two threads that both find 0 both ask the
// driver and store the same answer, which is harmless, so no lock or call_once is needed.
std::atomic<int> remembered_capability[kRememberedDevices];

}  // namespace

int compute_capability(int device) {
  if (device < 0 || device >= kRememberedDevices) return read_compute_capability(device);
  std::atomic<int>& slot = remembered_capability[device];
  int capability = slot.load(std::memory_order_relaxed);
  if (capability == 0) {
    capability = read_compute_capability(device);
    slot.store(capability, std::memory_order_relaxed);
  }
  return capability;
}

}  // namespace ampfuse::kernels::cuda
