// Argument checks shared by the FP8 ops (fp8.cpp, fp8_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

#include "../kernels/fp8_math.h"

namespace ampfuse::ops {

// The kernel format of a float8_e4m3fn / float8_e5m2 dtype; any other dtype is an error that
// says what `what` (an argument, or the requested output) must be.
inline kernels::Fp8Format fp8_format(const char* op, at::ScalarType dtype,
                                     const std::string& what) {
  if (dtype == at::kFloat8_e4m3fn) return kernels::Fp8Format::kE4M3;
  if (dtype == at::kFloat8_e5m2) return kernels::Fp8Format::kE5M2;
  TORCH_CHECK(false, "ampfuse.", op, ": ", what,
              " must be torch.float8_e4m3fn or "
              "torch.float8_e5m2, got ",
              dtype,
              ". ampfuse's FP8 formats are e4m3fn (weights "
              "and activations) and e5m2 (gradients); the fnuz variants are AMD's and not "
              "supported.");
}

// The input of the 2-D FP8 quantize ops (fp8_cast_transpose[_dbias], fp8_quantize_rowwise):
// a dense 2-D fp32/fp16/bf16 matrix [m, k] (callers flatten leading dimensions). Returns it
// contiguous (row-major), copied if it was not.
inline at::Tensor fp8_matrix_input(const char* op, const at::Tensor& input) {
  TORCH_CHECK(input.layout() == at::kStrided, "ampfuse.", op, ": input has layout ", input.layout(),
              "; pass a dense tensor (t.to_dense()).");
  TORCH_CHECK(input.dim() == 2, "ampfuse.", op, ": input must be 2-D [m, k], got shape ",
              input.sizes(),
              "; flatten the leading dimensions first (x.reshape(-1, x.shape[-1])).");
  return input.contiguous();
}

}  // namespace ampfuse::ops
