// fp8_transpose: a contiguous [k, m] copy of a 2-D FP8 tensor [m, k]. cuBLASLt's FP8 GEMMs
// take both operands K-contiguous, so an FP8 layer's backward needs its grad, its input and
// its weight transposed. CUDA stages tiles in shared memory (csrc/kernels/fp8_transpose.cu);
// the CPU copies through torch. The codes move as they are: NaN and inf codes included.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "cuda_context.h"
#include "fp8_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kTranspose = "fp8_transpose";

// fp8_transpose on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
at::Tensor fp8_transpose(const at::Tensor& input) {
  TORCH_CHECK(input.layout() == at::kStrided, "ampfuse.", kTranspose, ": input has layout ",
              input.layout(), "; pass a dense tensor (t.to_dense()).");
  fp8_format(kTranspose, input.scalar_type(), "input");
  TORCH_CHECK(input.dim() == 2, "ampfuse.", kTranspose,
              ": input must be 2-D (rows x "
              "columns), got shape ",
              input.sizes(),
              "; reshape it to 2-D first (an FP8 GEMM "
              "operand is a matrix).");
  const at::Tensor src = input.contiguous();  // row-major [m, k]
  if constexpr (kDevice == at::kCPU) {
    return src.t().contiguous();
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(src.device());
    at::Tensor out = at::empty({src.size(1), src.size(0)}, src.options());
    kernels::cuda::fp8_transpose(static_cast<const std::uint8_t*>(src.data_ptr()),
                                 static_cast<std::uint8_t*>(out.data_ptr()), src.size(0),
                                 src.size(1), current_stream(src.device()));
    return out;
#endif
  }
}

}  // namespace

OpKernels fp8_transpose_kernels() { return AMPFUSE_KERNELS(fp8_transpose); }

}  // namespace ampfuse::ops
