// Launchers of the FP8 CUDA work: the fused cast + amax, the multi-tensor delayed-scaling
// update and the cuBLASLt FP8 GEMM. Plain pointers and a stream, as in cuda_kernels.h; no
// torch and no CUDA headers. Nothing here synchronizes with the host; failures throw
// std::runtime_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "fp8_math.h"

namespace ampfuse::kernels::cuda {

// dst[i] = fp8 code of src[i] * *scale saturated to the format's range (fp8_math.h), and
// *amax = max(*amax, max |src|) with nan propagating. *amax must hold a value >= 0 or nan.
void fp8_cast_amax(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                   Fp8Format format, StreamHandle stream);

// update_fp8_scale (fp8_math.h) for every state, in as few launches as the kernel-argument
// table allows (one for up to kFp8StatesPerLaunch states). `skip` is a device flag (a
// found_inf: nonzero drops this step's amaxes) or null.
void fp8_update_scales(const std::vector<Fp8ScaleState>& states, float margin_factor,
                       bool use_max, const float* skip, StreamHandle stream);

// major * 10 + minor of a device (89 for Ada, 90 for Hopper).
int compute_capability(int device);

// out[m, n] = (a[m, :] . b[n, :]) * *a_scale_inv * *b_scale_inv (+ bias[n]) with a and b
// row-major fp8 (K contiguous, the "TN" layout cuBLASLt's FP8 kernels take) and fp32
// accumulation. out is bf16 or fp32 (row-major); bias, when given, is bf16 and needs a bf16
// out (cuBLASLt's FP8 kernels take a bf16 bias only). m, n, k are multiples of 16, pointers
// 16-byte aligned, and a and b are not both e5m2: the op layer checks all of it.
struct Fp8GemmArgs {
  const void* a;
  Fp8Format a_format;
  const void* b;
  Fp8Format b_format;
  std::int64_t m, n, k;
  const float* a_scale_inv;
  const float* b_scale_inv;
  const void* bias;
  void* out;
  DType out_dtype;
  void* workspace;
  std::size_t workspace_bytes;
};

void fp8_gemm(const Fp8GemmArgs& args, StreamHandle stream);

// out (cols x rows, row-major) = the transpose of in (rows x cols, row-major), one-byte FP8
// codes moved as they are (csrc/kernels/fp8_transpose.cu).
void fp8_transpose(const std::uint8_t* in, std::uint8_t* out, std::int64_t rows,
                   std::int64_t cols, StreamHandle stream);

// Bytes of workspace fp8_gemm is offered (cuBLAS's recommendation for Hopper).
constexpr std::size_t kFp8GemmWorkspaceBytes = std::size_t{32} << 20;

}  // namespace ampfuse::kernels::cuda
