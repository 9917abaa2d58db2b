// fp8_cast_transpose and fp8_cast_transpose_dbias: an FP8 layer's backward needs its grad
// quantized in both layouts (K-contiguous for each of its two GEMMs) and, with a bias, the
// grad's column sums. One pass over the input gives them all. The CPU loops are in
// csrc/kernels/cpu/fp8_quantize_kernels.cpp, the CUDA tiles in csrc/kernels/fp8_cast_transpose.cu.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <tuple>

#include "../kernels/cpu/fp8_quantize_kernels.h"
#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "checks.h"
#include "cuda_context.h"
#include "fp8_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kCastTranspose = "fp8_cast_transpose";
constexpr const char* kCastTransposeDbias = "fp8_cast_transpose_dbias";
// Elements per CPU task.
constexpr std::int64_t kGrain = std::int64_t{1} << 16;

// Both ops; dbias is filled only when `with_dbias`.
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_transpose(
    const char* op, const at::Tensor& input, const at::Tensor& scale, const at::Tensor& amax,
    at::ScalarType dtype, bool with_dbias) {
  const at::Tensor src = fp8_matrix_input(op, input);
  const kernels::DType src_dtype = kernel_dtype(op, src, ArgLabel{"input"});
  const kernels::Fp8Format format = fp8_format(op, dtype, "dtype");
  check_scalar_tensor(op, scale, "scale", at::kFloat, input.device(), "input");
  check_scalar_tensor(op, amax, "amax", at::kFloat, input.device(), "input");
  const std::int64_t rows = src.size(0);
  const std::int64_t cols = src.size(1);
  at::Tensor out = at::empty({rows, cols}, src.options().dtype(dtype));
  at::Tensor out_t = at::empty({cols, rows}, src.options().dtype(dtype));
  at::Tensor dbias = with_dbias ? at::empty({cols}, src.options().dtype(at::kFloat)) : at::Tensor();
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  auto* dst_t = static_cast<std::uint8_t*>(out_t.data_ptr());
  if constexpr (kDevice == at::kCPU) {
    const void* data = src.data_ptr();
    const float scale_value = *scale.data_ptr<float>();
    // At least 64 rows (about 64K elements) per task: a task's transposed writes then fill
    // 64-byte runs of out_t rows, and few cache lines are shared between tasks.
    const std::int64_t grain =
        std::max<std::int64_t>(64, (kGrain / std::max<std::int64_t>(cols, 1) + 63) / 64 * 64);
    std::atomic<std::uint32_t> largest{0};
    at::parallel_for(0, rows, grain, [&](std::int64_t begin, std::int64_t end) {
      const std::uint32_t bits = kernels::cpu::fp8_cast_transpose_rows(
          data, src_dtype, rows, cols, begin, end, scale_value, format, dst, dst_t);
      std::uint32_t seen = largest.load(std::memory_order_relaxed);
      while (bits > seen && !largest.compare_exchange_weak(seen, bits)) {
      }
    });
    // Fold into the amax already there, nan winning (as fp8_cast_amax).
    float* amax_ptr = amax.data_ptr<float>();
    const std::uint32_t folded = std::max(kernels::abs_bits(*amax_ptr), largest.load());
    *amax_ptr = __builtin_bit_cast(float, folded);
    if (with_dbias) {
      float* sums = dbias.data_ptr<float>();
      const std::int64_t col_grain =
          std::max<std::int64_t>(64, kGrain / std::max<std::int64_t>(rows, 1));
      at::parallel_for(0, cols, col_grain, [&](std::int64_t begin, std::int64_t end) {
        kernels::cpu::fp8_column_sums(data, src_dtype, rows, cols, begin, end, sums);
      });
    }
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(src.device());
    at::Tensor workspace;
    if (with_dbias) {
      workspace = at::empty(
          {std::max<std::int64_t>(kernels::cuda::fp8_dbias_workspace_floats(rows, cols), 1)},
          src.options().dtype(at::kFloat));
    }
    kernels::cuda::fp8_cast_transpose(
        {src.data_ptr(), src_dtype, rows, cols, scale.data_ptr<float>(), amax.data_ptr<float>(),
         dst, dst_t, with_dbias ? dbias.data_ptr<float>() : nullptr,
         with_dbias ? workspace.data_ptr<float>() : nullptr, format},
        current_stream(src.device()));
#endif
  }
  return {out, out_t, dbias};
}

// fp8_cast_transpose on kDevice (see the schema's comment).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> fp8_cast_transpose(const at::Tensor& input,
                                                      const at::Tensor& scale,
                                                      const at::Tensor& amax,
                                                      at::ScalarType dtype) {
  auto [out, out_t, unused] = cast_transpose<kDevice>(kCastTranspose, input, scale, amax, dtype,
                                                      /*with_dbias=*/false);
  return {out, out_t};
}

// fp8_cast_transpose_dbias on kDevice (see the schema's comment).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_transpose_dbias(const at::Tensor& input,
                                                                        const at::Tensor& scale,
                                                                        const at::Tensor& amax,
                                                                        at::ScalarType dtype) {
  return cast_transpose<kDevice>(kCastTransposeDbias, input, scale, amax, dtype,
                                 /*with_dbias=*/true);
}

}  // namespace

OpKernels fp8_cast_transpose_kernels() { return AMPFUSE_KERNELS(fp8_cast_transpose); }
OpKernels fp8_cast_transpose_dbias_kernels() { return AMPFUSE_KERNELS(fp8_cast_transpose_dbias); }

}  // namespace ampfuse::ops
