// The multi-tensor launch machinery shared by every list kernel: element
// load/store as fp32, 16-byte packs, per-block chunk lookup, the generic kernel
// and the launcher that walks a launch plan.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "chunk_visit.h"
#include "launch_check.cuh"
#include "launch_plan.h"
#include "nonfinite_kind.h"

namespace ampfuse::kernels::cuda {

constexpr int kThreadsPerBlock = 512;
constexpr int kMinBlocksPerSm = 2;

template <typename T>
struct DeviceElement;

template <>
struct DeviceElement<float> {
  static constexpr DType kDType = DType::kFloat32;
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};

template <>
struct DeviceElement<__half> {
  static constexpr DType kDType = DType::kFloat16;
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

template <>
struct DeviceElement<__nv_bfloat16> {
  static constexpr DType kDType = DType::kBFloat16;
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// Calls f with a null pointer of the storage type for `dtype`. A block's tensor
// has one dtype, so the branch is uniform across the block.
template <typename F>
__device__ void with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      f(static_cast<__half*>(nullptr));
      break;
    case DType::kBFloat16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      break;
    case DType::kFloat32:
      f(static_cast<float*>(nullptr));
      break;
  }
}

// N elements moved as one unit; for N*sizeof(T) >= 16 that is one or more
// 16-byte accesses, the widest a thread can issue.
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

__device__ inline bool is_aligned_16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// Whether p can be read as a Pack<T, N> (its alignment is its size up to 16 bytes).
template <typename T, int N>
__device__ inline bool is_aligned_for_pack(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % alignof(Pack<T, N>) == 0;
}

// The chunk this block owns: its slot in the table, and the element range.
struct BlockChunk {
  int slot;
  std::int64_t start;
  int size;
};

template <int Depth>
__device__ BlockChunk block_chunk(const ChunkTable<Depth>& table) {
  const SlotChunk owned = chunk_of_block(table, static_cast<std::int32_t>(blockIdx.x));
  const std::int64_t start = owned.chunk * kChunkSize;
  const std::int64_t left = table.numel[owned.slot] - start;
  return {owned.slot, start, static_cast<int>(left < kChunkSize ? left : kChunkSize)};
}

// Visits elements [0, n) of a chunk: full packs of N at offsets that are
// multiples of N when `aligned`, the rest one element at a time. The optimizer kernels use
// this one-pack-at-a-time walk. Written as visit_chunk_in_batches<N, 1>, the same walk, it
// compiled Adam to 108 bytes of spills (24 now) and SGD to 64 registers (56), so it stays.
template <int N, typename PackOp, typename ElementOp>
__device__ void visit_chunk(int n, bool aligned, PackOp&& pack_op, ElementOp&& element_op) {
  const int packed_end = aligned ? n - n % N : 0;
  for (int i = threadIdx.x * N; i < packed_end; i += blockDim.x * N) pack_op(i);
  for (int i = packed_end + threadIdx.x; i < n; i += blockDim.x) element_op(i);
}

// The same walk with each pack's load split from its use, and several loads in flight per
// thread (chunk_visit.h). kLoadBytesInFlight / sizeof(pack) packs go per batch: 64 bytes, four
// 16-byte loads, so that the 3-4 blocks of 512 threads an SM runs of a list kernel keep
// 96-128 KB of reads in flight instead of 24-32 KB.
constexpr int kLoadBytesInFlight = 64;

template <typename PackT>
constexpr int batch_for() {
  return sizeof(PackT) >= kLoadBytesInFlight ? 1 : kLoadBytesInFlight / sizeof(PackT);
}

template <int N, typename PackT, typename Load, typename Use, typename ElementOp>
__device__ void visit_chunk_batched(int n, bool aligned, Load&& load, Use&& use,
                                    ElementOp&& element_op) {
  visit_chunk_in_batches<N, batch_for<PackT>()>(static_cast<int>(threadIdx.x), kThreadsPerBlock, n,
                                                aligned, load, use, element_op);
}

// The sign bit of each lane of `pack` that holds an inf or nan (nonfinite_lanes on each of
// its 32-bit words, ORed); 0 when all are finite.
template <typename T, int N>
__device__ std::uint32_t nonfinite_lanes(const Pack<T, N>& pack) {
  static_assert(sizeof(Pack<T, N>) % sizeof(std::uint32_t) == 0, "whole 32-bit words");
  constexpr NonfiniteWordTest test = nonfinite_word_test(DeviceElement<T>::kDType);
  constexpr int kWords = sizeof(Pack<T, N>) / sizeof(std::uint32_t);
  std::uint32_t words[kWords];
  memcpy(words, &pack, sizeof(words));  // register moves, without type punning
  std::uint32_t lanes = 0;
#pragma unroll
  for (int w = 0; w < kWords; ++w) lanes |= nonfinite_lanes(words[w], test);
  return lanes;
}

// `value` combined over the block with `combine` (associative; 0 must be its identity for the
// values passed, as for a sum or for a maximum of non-negative values); the result is valid in
// thread 0. Every thread of the block must call it. It may be called again right after: the
// second barrier keeps the next call's writes to the shared buffer from overtaking this call's
// reads of it.
template <typename T, typename Combine>
__device__ T block_reduce(T value, Combine combine) {
  __shared__ T warp_values[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value = combine(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_values[warp] = value;
  __syncthreads();
  value = threadIdx.x < blockDim.x / 32 ? warp_values[threadIdx.x] : T(0);
  __syncthreads();
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) {
      value = combine(value, __shfl_down_sync(0xffffffffu, value, offset));
    }
  }
  return value;
}

// Sum over the block, as block_reduce.
template <typename T>
__device__ T block_sum(T value) {
  return block_reduce(value, [](T a, T b) { return a + b; });
}

// The first chunk whose owner is >= tensor, in the chunk_owner array that per-chunk reductions
// (l2norm, lamb) fill with each chunk's list index: sorted, since chunks follow list order.
__device__ inline std::int64_t first_chunk_of(const std::int32_t* chunk_owner, std::int64_t chunks,
                                              std::int32_t tensor) {
  std::int64_t lo = 0, hi = chunks;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (chunk_owner[mid] < tensor) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Blocks per SM a functor's kernel is compiled for (its launch bounds, hence its register
// cap): Functor::kMinBlocksPerSm where the functor says, kMinBlocksPerSm otherwise. At least
// two: that caps registers at 64 per thread (Adam would take 72 on sm_90; see
// docs/design/kernels.md for its one spilled value). The list kernels ask for the occupancy they
// had with one load in flight per thread (3 or 4 blocks), so batching loads (chunk_visit.h)
// costs them no warps.
//
// An SM holds at most kMaxThreadsPerSm threads: 2048 on sm_80, 87, 90 and 100, 1536 on sm_86,
// 89 and 12x, 1024 on Turing (sm_75). A request for more blocks than fit is ignored by ptxas
// (with a warning) and leaves the registers uncapped, so the request is clipped to what the
// architecture being compiled holds. __CUDA_ARCH__ exists only in the device pass; the host
// pass never reads launch bounds.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 750)
constexpr int kMaxThreadsPerSm = 1024;
#elif defined(__CUDA_ARCH__) && \
    (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
constexpr int kMaxThreadsPerSm = 1536;
#else
constexpr int kMaxThreadsPerSm = 2048;
#endif

constexpr int clip_blocks_per_sm(int requested) {
  return requested < kMaxThreadsPerSm / kThreadsPerBlock ? requested
                                                         : kMaxThreadsPerSm / kThreadsPerBlock;
}

template <typename Functor, typename = void>
struct MinBlocksPerSm : std::integral_constant<int, clip_blocks_per_sm(kMinBlocksPerSm)> {};

template <typename Functor>
struct MinBlocksPerSm<Functor, std::void_t<decltype(Functor::kMinBlocksPerSm)>>
    : std::integral_constant<int, clip_blocks_per_sm(Functor::kMinBlocksPerSm)> {};

// The table travels as a __grid_constant__ kernel parameter, so blocks read it
// straight from constant parameter space without a per-thread copy.
template <int Depth, typename Functor, typename... Args>
__global__ void __launch_bounds__(kThreadsPerBlock, MinBlocksPerSm<Functor>::value)
    multi_tensor_kernel(const __grid_constant__ ChunkTable<Depth> table, Functor functor,
                        Args... args) {
  functor(table, args...);
}

// Kernel parameters over 4 KB need a driver for CUDA 12.1 or newer. An older driver can
// still load a CUDA 12.x build (minor-version compatibility), so say what is wrong here
// rather than leave it to a failed launch.
inline void require_large_kernel_parameters() {
  static const int driver = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess ? version : 0;
  }();
  if (driver < 12010) {
    throw std::runtime_error(
        "ampfuse: the installed NVIDIA driver supports CUDA " + std::to_string(driver / 1000) +
        "." + std::to_string(driver % 1000 / 10) +
        ", but ampfuse's multi-tensor kernels pass 32 KB kernel parameters, which need CUDA "
        "12.1 (driver 530) or newer. Update the NVIDIA driver.");
  }
}

// Runs functor over every chunk of `lists` (Depth parallel lists) on `stream`. With `ids`, each
// table slot's list_index is replaced by ids[list_index]: an identity the caller gives each
// tensor (the optimizers' param ids, which key stochastic rounding), read by the functor.
template <int Depth, typename Functor, typename... Args>
void launch_multi_tensor_with_ids(const char* what,
                                  const std::vector<TensorRef>* const lists[Depth],
                                  const std::vector<std::int32_t>* ids, StreamHandle stream,
                                  Functor functor, Args... args) {
  // Padding between parameters is at most 8 bytes each (no argument is over-aligned).
  static_assert(sizeof(ChunkTable<Depth>) + sizeof(Functor) + (sizeof(Args) + ... + 0) +
                        8 * (sizeof...(Args) + 1) <=
                    kMaxKernelParamBytes,
                "kernel parameters over CUDA's 32,764-byte limit: shrink kChunkTableBytes");
  require_large_kernel_parameters();
  plan_launches<Depth>(lists, [&](const ChunkTable<Depth>& planned, int blocks) {
    const auto launch = [&](const ChunkTable<Depth>& table) {
      multi_tensor_kernel<Depth>
          <<<blocks, kThreadsPerBlock, 0, reinterpret_cast<cudaStream_t>(stream)>>>(table, functor,
                                                                                    args...);
      throw_on_launch_error(what);
    };
    if (ids == nullptr) {
      launch(planned);
      return;
    }
    ChunkTable<Depth> relabeled = planned;
    for (int slot = 0; slot < relabeled.tensors; ++slot) {
      relabeled.list_index[slot] = (*ids)[relabeled.list_index[slot]];
    }
    launch(relabeled);
  });
}

template <int Depth, typename Functor, typename... Args>
void launch_multi_tensor(const char* what, const std::vector<TensorRef>* const lists[Depth],
                         StreamHandle stream, Functor functor, Args... args) {
  launch_multi_tensor_with_ids<Depth>(what, lists, nullptr, stream, functor, args...);
}

}  // namespace ampfuse::kernels::cuda
