// fp8_gemm: out = (a . b^T) * a_scale_inv * b_scale_inv (+ bias) for fp8 a [m, k] and b [n, k].
// CUDA runs cuBLASLt's FP8 kernels (csrc/kernels/fp8_gemm.cu); the CPU emulates them in fp32:
// fp8 products are exact in fp32, so the two differ only in accumulation order.
// Both devices accept the same arguments, so a model that runs on the CPU runs on a GPU.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <c10/util/Exception.h>

#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "checks.h"
#include "cuda_context.h"
#include "fp8_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kGemm = "fp8_gemm";

// fp8_gemm on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                    const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                    at::ScalarType out_dtype) {
  const kernels::Fp8Format a_format = fp8_format(kGemm, a.scalar_type(), "a");
  const kernels::Fp8Format b_format = fp8_format(kGemm, b.scalar_type(), "b");
  TORCH_CHECK(a_format == kernels::Fp8Format::kE4M3 || b_format == kernels::Fp8Format::kE4M3,
              "ampfuse.", kGemm, ": a and b are both float8_e5m2; cuBLASLt's FP8 GEMMs take at "
              "most one e5m2 operand. Quantize one of them (the weight or the activation) to "
              "float8_e4m3fn.");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "ampfuse.", kGemm, ": a and b must be 2-D, got "
              "shapes ", a.sizes(), " and ", b.sizes(), "; flatten leading dimensions first.");
  TORCH_CHECK(a.size(1) == b.size(1), "ampfuse.", kGemm, ": a is ", a.sizes(), " and b is ",
              b.sizes(), "; both hold K along dimension 1 (out = a @ b.T), so their sizes there "
              "must agree.");
  TORCH_CHECK(a.device() == b.device(), "ampfuse.", kGemm, ": a is on ", a.device(),
              " but b is on ", b.device(), "; move both to one device.");
  const std::int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  TORCH_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0, "ampfuse.", kGemm, ": m=", m, ", n=",
              n, ", k=", k, " must all be multiples of 16 (cuBLASLt's FP8 layout rule); pad the "
              "rows of a (e.g. the batch) with zeros up to a multiple of 16.");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "ampfuse.", kGemm, ": a and b must be "
              "row-major contiguous with K contiguous (the TN layout of FP8 GEMMs); pass "
              "a.contiguous() and b.contiguous() (for b = w.T, a transposed copy of w).");
  check_scalar_tensor(kGemm, a_scale_inv, "a_scale_inv", at::kFloat, a.device(), "a");
  check_scalar_tensor(kGemm, b_scale_inv, "b_scale_inv", at::kFloat, a.device(), "a");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "ampfuse.", kGemm,
              ": out_dtype must be torch.bfloat16 or torch.float32, got ", out_dtype, ".");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == out_dtype &&
                    bias->device() == a.device(),
                "ampfuse.", kGemm, ": bias must be a 1-D tensor of n=", n, " elements with "
                "dtype out_dtype (", out_dtype, ") on ", a.device(), ", got shape ",
                bias->sizes(), ", dtype ", bias->scalar_type(), " on ", bias->device(), ".");
  }
  if constexpr (kDevice == at::kCPU) {
    // What the GPU computes: exact fp8 products summed in fp32, the sum times the product of
    // the two scale_invs, plus the bias, rounded once to out_dtype.
    at::Tensor out = at::mm(a.to(at::kFloat), b.to(at::kFloat).t());
    out.mul_(at::mul(a_scale_inv, b_scale_inv));
    if (bias.has_value()) out.add_(bias->to(at::kFloat));
    return out.to(out_dtype);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const int device = a.device().index();
    const int capability = kernels::cuda::compute_capability(device);
    TORCH_CHECK(capability >= 89, "ampfuse.", kGemm, ": CUDA device ", device, " has compute "
                "capability ", capability / 10, ".", capability % 10, "; FP8 GEMMs need 8.9 or "
                "newer (Ada, Hopper, Blackwell). Train this model without fp8, or on such a GPU.");
    for (const at::Tensor* t : {&a, &b}) {
      TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 == 0, "ampfuse.", kGemm,
                  ": a and b must start on a 16-byte boundary (cuBLASLt's rule); pass a fresh "
                  "copy (t.clone()) instead of a view into another tensor.");
    }
    const c10::cuda::CUDAGuard guard(a.device());
    at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
    at::Tensor workspace =
        at::empty({static_cast<std::int64_t>(kernels::cuda::kFp8GemmWorkspaceBytes)},
                  a.options().dtype(at::kByte));
    // cuBLASLt's FP8 kernels take a bf16 bias only; an fp32 out gets its fp32 bias added after,
    // which keeps the bias's bits.
    const bool fused_bias = bias.has_value() && out_dtype == at::kBFloat16;
    kernels::cuda::Fp8GemmArgs args{a.data_ptr(), a_format, b.data_ptr(), b_format, m, n, k,
                                    a_scale_inv.data_ptr<float>(), b_scale_inv.data_ptr<float>(),
                                    fused_bias ? bias->data_ptr() : nullptr, out.data_ptr(),
                                    out_dtype == at::kBFloat16 ? kernels::DType::kBFloat16
                                                               : kernels::DType::kFloat32,
                                    workspace.data_ptr(), kernels::cuda::kFp8GemmWorkspaceBytes};
    kernels::cuda::fp8_gemm(args, current_stream(a.device()));
    if (bias.has_value() && !fused_bias) out.add_(*bias);
    return out;
#endif
  }
}

}  // namespace

OpKernels fp8_gemm_kernels() { return AMPFUSE_KERNELS(fp8_gemm); }

}  // namespace ampfuse::ops
