// Runs ampfuse's CUDA kernels on the CPU, for machines without a GPU (CI, and most of our
// build machines): force-included (-include) before a kernel file whose launches
// rewrite_launches.py has turned into calls of ampfuse_emu::launch. Blocks run one after
// another; a block's threads run as fibers that meet at __syncthreads and at warp shuffles
// (emulated_cuda.cpp), so shared memory, barriers and shuffles behave as the kernels expect.
// Shuffles are emulated for a full mask and width 32 only, what every kernel uses.
//
// What it proves and what it cannot: the kernels' indexing, tiling, barriers, reductions,
// vector paths and edge handling, and that they produce the CPU kernels' bits when every
// operation rounds as written (the files compile with -ffp-contract=off). It cannot see what
// only hardware shows: nvcc contracting a * b + c into one FMA, inter-block races (blocks do
// not overlap here), memory-model or timing bugs, occupancy, register limits, and the device
// branches of the headers shared with the CPU (see the end of this file).
//
// Everything CUDA-specific is renamed into ampfuse_emu (and the kernels' namespace
// ampfuse::kernels::cuda into ampfuse::kernels::emulated_cuda), so a test binary may also link
// the real CUDA launchers and libcudart without a clash.
#pragma once

// The real toolkit headers first, compiled as plain host code (no __CUDACC__): they give the
// types (dim3, uint4, __half, __nv_bfloat16, cudaError_t) and host conversions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace ampfuse_emu {

// What the builtins threadIdx, blockIdx, blockDim and gridDim read: the running thread's.
struct ThreadContext;
ThreadContext& current();

struct Config {
  Config(dim3 grid_, dim3 block_, std::size_t shared_bytes_ = 0, cudaStream_t stream_ = nullptr)
      : grid(grid_), block(block_), shared_bytes(shared_bytes_), stream(stream_) {}
  dim3 grid;
  dim3 block;
  std::size_t shared_bytes;
  cudaStream_t stream;
};

// Runs body() once per thread of each block of cfg (blocks in order, a block's threads as
// fibers), or records cudaErrorInvalidConfiguration where a real launch would fail.
void run_grid(const Config& cfg, const std::function<void()>& body);

template <typename Kernel, typename... Args>
void launch(const Config& cfg, Kernel kernel, Args&&... args) {
  // Kernel parameters are copied at the launch, as CUDA copies them into parameter space.
  const std::tuple<std::decay_t<Args>...> params(std::forward<Args>(args)...);
  run_grid(cfg, [&] { std::apply(kernel, params); });
}

// Builtins.
struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// __syncthreads at file:line (the kernel's call site: threads at different ones stop the run).
void syncthreads(const char* file, int line);
// Fills a __shared__ variable with 0xff bytes the first time each block reaches its declaration
// (rewrite_launches.py adds the call), so no block reads what the previous one left there.
void fresh_shared(void* p, std::size_t bytes);
// Every lane's value, and what lane `source_lane` gave: a full-mask shuffle of the warp.
std::uint64_t warp_exchange(std::uint64_t value, int source_lane, const char* op);
// Stops the run unless the shuffle is the one emulated: full mask, width 32, offset below 32
// (what every kernel uses; CUDA's other cases are not modelled).
void require_whole_warp(unsigned mask, int width, unsigned offset, const char* op);
int lane_id();

template <typename T>
std::uint64_t to_word(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  std::uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(T));
  return w;
}
template <typename T>
T from_word(std::uint64_t w) {
  T v;
  std::memcpy(&v, &w, sizeof(T));
  return v;
}

// Runtime API the kernels' launchers call.
cudaError_t get_last_error();
cudaError_t peek_at_last_error();
const char* get_error_string(cudaError_t error);
cudaError_t memset_async(void* p, int value, std::size_t bytes, cudaStream_t stream);
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t driver_get_version(int* version);
// Memory: "device" memory is host memory, so pointers are read directly by the test too.
cudaError_t malloc_device(void** p, std::size_t bytes);
cudaError_t free_device(void* p);
cudaError_t memcpy_any(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t memset_sync(void* p, int value, std::size_t bytes);
cudaError_t synchronize();
cudaError_t get_device_count(int* count);
cudaError_t get_device(int* device);
cudaError_t set_device(int device);
const char* get_error_name(cudaError_t error);

template <typename T>
cudaError_t malloc_device(T** p, std::size_t bytes) {
  return malloc_device(reinterpret_cast<void**>(p), bytes);
}

}  // namespace ampfuse_emu

#define threadIdx (::ampfuse_emu::current().thread_idx)
#define blockIdx (::ampfuse_emu::current().block_idx)
#define blockDim (::ampfuse_emu::current().block_dim)
#define gridDim (::ampfuse_emu::current().grid_dim)
#define warpSize 32

#define cudaGetLastError ::ampfuse_emu::get_last_error
#define cudaPeekAtLastError ::ampfuse_emu::peek_at_last_error
#define cudaGetErrorString ::ampfuse_emu::get_error_string
#define cudaMemsetAsync ::ampfuse_emu::memset_async
#define cudaDeviceGetAttribute ::ampfuse_emu::device_get_attribute
#define cudaDriverGetVersion ::ampfuse_emu::driver_get_version
#define cudaMalloc ::ampfuse_emu::malloc_device
#define cudaFree ::ampfuse_emu::free_device
#define cudaMemcpy ::ampfuse_emu::memcpy_any
#define cudaMemset ::ampfuse_emu::memset_sync
#define cudaDeviceSynchronize ::ampfuse_emu::synchronize
#define cudaStreamSynchronize(stream) ::ampfuse_emu::synchronize()
#define cudaGetDeviceCount ::ampfuse_emu::get_device_count
#define cudaGetDevice ::ampfuse_emu::get_device
#define cudaSetDevice ::ampfuse_emu::set_device
#define cudaGetErrorName ::ampfuse_emu::get_error_name

#define __syncthreads() ::ampfuse_emu::syncthreads(__FILE__, __LINE__)

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  ::ampfuse_emu::require_whole_warp(mask, width, static_cast<unsigned>(lane_mask),
                                    "__shfl_xor_sync");
  return ::ampfuse_emu::from_word<T>(::ampfuse_emu::warp_exchange(
      ::ampfuse_emu::to_word(value), ::ampfuse_emu::lane_id() ^ lane_mask, "__shfl_xor_sync"));
}

// A lane whose source would be past the warp's end gets its own value, as in CUDA.
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  ::ampfuse_emu::require_whole_warp(mask, width, delta, "__shfl_down_sync");
  const int lane = ::ampfuse_emu::lane_id();
  const int source = lane + static_cast<int>(delta);
  return ::ampfuse_emu::from_word<T>(::ampfuse_emu::warp_exchange(
      ::ampfuse_emu::to_word(value), source < 32 ? source : lane, "__shfl_down_sync"));
}

// The atomics the kernels use (real ones, though the fibers of a launch share a host thread).
inline unsigned atomicMax(unsigned* p, unsigned v) {
  std::atomic_ref<unsigned> a(*p);
  unsigned old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
inline unsigned atomicAnd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_and(v);
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_or(v);
}
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }

// The device intrinsics the kernels call (cuda_fp16.h and cuda_bf16.h give the conversions).
inline float __uint_as_float(unsigned u) { return __builtin_bit_cast(float, u); }
inline unsigned __float_as_uint(float f) { return __builtin_bit_cast(unsigned, f); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

// CUDA's unqualified min / max overloads of device code.
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }

// The kernel-language keywords, now that the toolkit headers are in. __shared__ becomes
// static: one block runs at a time, so a static is exactly one block's shared memory (filled
// with 0xff bytes as each block first reaches it: fresh_shared).
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __constant__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

// __CUDACC__ and __CUDA_ARCH__ stay undefined: the headers shared with the CPU kernels
// (fp8_math.h, optimizer_math.h, state_codes.h, ...) then compile as the CPU library compiles
// them, token for token, so a test binary that links both has one definition of each inline
// function. Their device branches only swap an operator for its intrinsic (a * b for
// __fmul_rn, a bit cast for __float_as_uint).

// The kernels' namespace, renamed (see the top of the file).
#define cuda emulated_cuda
