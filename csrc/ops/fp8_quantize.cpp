// Current scaling (this step's amax gives this step's scale): fp8_tensor_scale, one scale for a
// whole tensor, and fp8_quantize_rowwise, one scale per row (or per column, written
// transposed). The scale rule is current_fp8_scale (csrc/kernels/fp8_math.h); the CPU loops
// are in csrc/kernels/cpu/fp8_quantize_kernels.cpp and the CUDA kernels in
// csrc/kernels/fp8_current_scaling.cu
// (whole-tensor scale) and csrc/kernels/fp8_cast_transpose.cu (rowwise).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>

#include "../kernels/cpu/fp8_quantize_kernels.h"
#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "checks.h"
#include "cuda_context.h"
#include "fp8_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kTensorScale = "fp8_tensor_scale";
constexpr const char* kRowwise = "fp8_quantize_rowwise";
// Elements per CPU task of the amax reduction.
constexpr std::int64_t kAmaxGrain = std::int64_t{1} << 16;

// fp8_tensor_scale on kDevice (see ../ops.h and the schema's comment).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_tensor_scale(const at::Tensor& input,
                                                                at::ScalarType dtype,
                                                                double margin) {
  TORCH_CHECK(input.layout() == at::kStrided, "ampfuse.", kTensorScale, ": input has layout ",
              input.layout(), "; pass a dense tensor (t.to_dense()).");
  const kernels::DType src_dtype = kernel_dtype(kTensorScale, input, ArgLabel{"input"});
  const kernels::Fp8Format format = fp8_format(kTensorScale, dtype, "dtype");
  TORCH_CHECK(std::isfinite(margin) && margin >= 0.0 && margin <= 64.0, "ampfuse.", kTensorScale,
              ": margin must be a finite number between 0 and 64 (the scale is "
              "divided by 2**margin), got ",
              margin, ".");
  const float margin_factor = static_cast<float>(std::exp2(margin));
  const float fp8_max = kernels::fp8_max(format);
  const at::Tensor src = input.contiguous();
  const auto options = input.options().dtype(at::kFloat);
  at::Tensor amax = at::empty({1}, options);
  at::Tensor scale = at::empty({1}, options);
  at::Tensor scale_inv = at::empty({1}, options);
  if constexpr (kDevice == at::kCPU) {
    const kernels::DType d = src_dtype;
    const auto* base = static_cast<const char*>(src.data_ptr());
    const std::int64_t size = kernels::element_size(d);
    const std::uint32_t bits = at::parallel_reduce(
        0, src.numel(), kAmaxGrain, std::uint32_t{0},
        [&](std::int64_t begin, std::int64_t end, std::uint32_t seen) {
          return std::max(seen, kernels::cpu::fp8_amax_span(base + begin * size, d, end - begin));
        },
        [](std::uint32_t a, std::uint32_t b) { return std::max(a, b); });
    const float amax_value = __builtin_bit_cast(float, bits);
    const float scale_value = kernels::current_fp8_scale(amax_value, fp8_max, margin_factor);
    *amax.data_ptr<float>() = amax_value;
    *scale.data_ptr<float>() = scale_value;
    *scale_inv.data_ptr<float>() = 1.0f / scale_value;
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    kernels::cuda::fp8_tensor_scale(
        {src.data_ptr(), src.numel(), src_dtype}, amax.data_ptr<float>(), scale.data_ptr<float>(),
        scale_inv.data_ptr<float>(), fp8_max, margin_factor, current_stream(input.device()));
#endif
  }
  return {amax, scale, scale_inv};
}

// fp8_quantize_rowwise on kDevice (see ../ops.h and the schema's comment).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> fp8_quantize_rowwise(const at::Tensor& input,
                                                        at::ScalarType dtype, bool transpose) {
  const at::Tensor src = fp8_matrix_input(kRowwise, input);
  const kernels::DType src_dtype = kernel_dtype(kRowwise, src, ArgLabel{"input"});
  const kernels::Fp8Format format = fp8_format(kRowwise, dtype, "dtype");
  const std::int64_t rows = src.size(0);
  const std::int64_t cols = src.size(1);
  at::Tensor out = transpose ? at::empty({cols, rows}, src.options().dtype(dtype))
                             : at::empty({rows, cols}, src.options().dtype(dtype));
  at::Tensor scale_inv = at::empty({transpose ? cols : rows}, src.options().dtype(at::kFloat));
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  float* inv = scale_inv.data_ptr<float>();
  if constexpr (kDevice == at::kCPU) {
    const void* data = src.data_ptr();
    if (!transpose) {
      // Rows per task: about 64K elements each.
      const std::int64_t grain =
          std::max<std::int64_t>(1, kAmaxGrain / std::max<std::int64_t>(cols, 1));
      at::parallel_for(0, rows, grain, [&](std::int64_t begin, std::int64_t end) {
        kernels::cpu::fp8_quantize_rows(data, src_dtype, cols, begin, end, format, dst, inv);
      });
    } else {
      const std::int64_t grain =
          std::max<std::int64_t>(64, kAmaxGrain / std::max<std::int64_t>(rows, 1));
      at::parallel_for(0, cols, grain, [&](std::int64_t begin, std::int64_t end) {
        kernels::cpu::fp8_quantize_columns_transposed(data, src_dtype, rows, cols, begin, end,
                                                      format, dst, inv);
      });
    }
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(src.device());
    // An empty row (or column) has amax 0, hence scale 1: the kernels have no element to visit.
    if (rows == 0 || cols == 0) scale_inv.fill_(1.0f);
    at::Tensor workspace;
    if (transpose)
      workspace = at::empty({std::max<std::int64_t>(cols, 1)}, src.options().dtype(at::kInt));
    kernels::cuda::fp8_quantize_rowwise(
        src.data_ptr(), src_dtype, rows, cols, transpose, dst, inv,
        transpose ? static_cast<std::uint32_t*>(workspace.data_ptr()) : nullptr, format,
        current_stream(src.device()));
#endif
  }
  return {out, scale_inv};
}

}  // namespace

OpKernels fp8_tensor_scale_kernels() { return AMPFUSE_KERNELS(fp8_tensor_scale); }
OpKernels fp8_quantize_rowwise_kernels() { return AMPFUSE_KERNELS(fp8_quantize_rowwise); }

}  // namespace ampfuse::ops
