// Torch-free description of the element types the kernels handle.
#pragma once

#include <cstdint>

namespace ampfuse::kernels {

// The floating-point formats of mixed-precision training. Everything else
// (float64, integers, complex) is refused by the op layer before a kernel runs.
enum class DType : std::int8_t { kFloat32, kFloat16, kBFloat16 };

constexpr int element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Opaque CUDA stream handle, spelled the way cuda_runtime.h spells cudaStream_t,
// so launcher declarations need no CUDA header and compile in CPU-only builds.
struct CUstream_st;
using StreamHandle = CUstream_st*;

// One contiguous run of `numel` elements of type `dtype` starting at `data`.
struct TensorRef {
  void* data;
  std::int64_t numel;
  DType dtype;
};

}  // namespace ampfuse::kernels
