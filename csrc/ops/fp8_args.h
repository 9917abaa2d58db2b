// Argument checks shared by the FP8 ops (fp8.cpp, fp8_gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

#include "../kernels/fp8_math.h"

namespace ampfuse::ops {

// The kernel format of a float8_e4m3fn / float8_e5m2 dtype; any other dtype is an error that
// says what `what` (an argument, or the requested output) must be.
inline kernels::Fp8Format fp8_format(const char* op, at::ScalarType dtype, const std::string& what) {
  if (dtype == at::kFloat8_e4m3fn) return kernels::Fp8Format::kE4M3;
  if (dtype == at::kFloat8_e5m2) return kernels::Fp8Format::kE5M2;
  TORCH_CHECK(false, "ampfuse.", op, ": ", what, " must be torch.float8_e4m3fn or "
              "torch.float8_e5m2, got ", dtype, ". ampfuse's FP8 formats are e4m3fn (weights "
              "and activations) and e5m2 (gradients); the fnuz variants are AMD's and not "
              "supported.");
}

}  // namespace ampfuse::ops
