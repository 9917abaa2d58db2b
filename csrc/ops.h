// What each op file (csrc/ops/*.cpp) hands to the one list of ops, csrc/registration.cpp.
//
// An op is one function template over the device, with the schema's arguments written once;
// the checks are shared and only the end differs per device:
//
//   template <c10::DeviceType kDevice>
//   void fused_adam_(at::TensorList params, ...) {
//     ... the checks ...
//     if constexpr (kDevice == at::kCPU) {
//       ... the CPU spans ...
//     } else {
//   #ifdef AMPFUSE_WITH_CUDA
//       ... the CUDA launch ...
//   #endif
//     }
//   }
//   OpKernels fused_adam_kernels() { return AMPFUSE_KERNELS(fused_adam_); }
//
// Its two instantiations are separate CPU and CUDA kernels to the dispatcher, as two written
// functions were: a call picks one by its tensors' dispatch keys, and opcheck, torch.compile
// and the fake kernels see the schema.
#pragma once

#include <c10/core/DeviceType.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace ampfuse::ops {

struct OpKernels {
  torch::CppFunction cpu;
  std::optional<torch::CppFunction> cuda = std::nullopt;  // CUDA builds only
  // For arguments that no CPU or CUDA kernel takes (the CompositeExplicitAutograd key), where
  // an op has something better to do than refusals.h's refusal (an empty list's result).
  std::optional<torch::CppFunction> fallback = std::nullopt;
};

// Every op's kernels; each comes from the op's own file.
OpKernels multi_tensor_unscale_kernels();          // csrc/ops/scale.cpp
OpKernels multi_tensor_scale_kernels();            // csrc/ops/scale.cpp
OpKernels multi_tensor_nonfinite_check_kernels();  // csrc/ops/scale.cpp
OpKernels multi_tensor_l2norm_kernels();           // csrc/ops/l2norm.cpp
OpKernels update_scale_kernels();                  // csrc/ops/update_scale.cpp
OpKernels fused_adam_kernels();                    // csrc/ops/adam.cpp
OpKernels fused_adam_coded_kernels();              // csrc/ops/adam_coded.cpp
OpKernels fused_sgd_kernels();                     // csrc/ops/sgd.cpp
OpKernels fused_adagrad_kernels();                 // csrc/ops/adagrad.cpp
OpKernels fused_lamb_kernels();                    // csrc/ops/lamb.cpp
OpKernels fused_lamb_coded_kernels();              // csrc/ops/lamb_coded.cpp
OpKernels fused_novograd_kernels();                // csrc/ops/novograd.cpp
OpKernels fp8_cast_amax_kernels();                 // csrc/ops/fp8.cpp
OpKernels fp8_update_scales_kernels();             // csrc/ops/fp8.cpp
OpKernels fp8_gemm_kernels();                      // csrc/ops/fp8_gemm.cpp
// {plans built, plans reused, plans evicted, per-thread capacity} of fp8_gemm's cuBLASLt plan
// cache (all 0 without CUDA): a host-side catch-all function, not a tensor op.
std::vector<std::int64_t> fp8_gemm_plan_stats();  // csrc/ops/fp8_gemm.cpp
OpKernels fp8_transpose_kernels();                // csrc/ops/fp8_transpose.cpp
OpKernels fp8_tensor_scale_kernels();             // csrc/ops/fp8_quantize.cpp
OpKernels fp8_quantize_rowwise_kernels();         // csrc/ops/fp8_quantize.cpp
OpKernels fp8_cast_transpose_kernels();           // csrc/ops/fp8_cast_transpose.cpp
OpKernels fp8_cast_transpose_dbias_kernels();     // csrc/ops/fp8_cast_transpose.cpp

}  // namespace ampfuse::ops

// An op template's kernels: at at::kCPU and, in CUDA builds, at::kCUDA. A macro only because a
// build without CUDA must not instantiate the CUDA kernel, whose launch it compiles out.
#ifdef AMPFUSE_WITH_CUDA
#define AMPFUSE_KERNELS(op)                                               \
  ::ampfuse::ops::OpKernels {                                             \
    torch::CppFunction(&op<at::kCPU>), torch::CppFunction(&op<at::kCUDA>) \
  }
#else
#define AMPFUSE_KERNELS(op) \
  ::ampfuse::ops::OpKernels { torch::CppFunction(&op<at::kCPU>) }
#endif
