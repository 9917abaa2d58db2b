// fp8_gemm: out = (a . b^T) * scales (+ bias) for fp8 a [m, k] and b [n, k], with the scales
// either tensorwise (one a_scale_inv, one b_scale_inv) or rowwise (a_scale_inv[i] per row of a,
// b_scale_inv[j] per row of b). CUDA runs cuBLASLt's FP8 kernels (csrc/kernels/fp8_gemm.cu);
// the CPU emulates them in fp32: fp8 products are exact in fp32, so the two differ only in
// accumulation order. Both devices accept the same arguments, so a model that runs on the CPU
// runs on a GPU. This op runs three times per FP8 Linear per step: the checks below read only
// tensor metadata (no device sync, no allocation).
//
// Errors: a problem this GPU or its cuBLASLt cannot run (compute capability below 8.9, rowwise
// scales below 9.0, no cuBLASLt algorithm, a refused scale mode or first launch) raises
// NotImplementedError (c10::NotImplementedError, TORCH_CHECK_NOT_IMPLEMENTED), and only such
// a problem does: bad arguments and real failures stay RuntimeError (NotImplementedError is a
// subclass of it, so code catching RuntimeError is unaffected). ampfuse.fp8's rowwise Linear
// reads NotImplementedError as "run this GEMM through torch._scaled_mm instead".
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#ifdef AMPFUSE_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#endif

#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "checks.h"
#include "cuda_context.h"
#include "fp8_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kGemm = "fp8_gemm";

// Tensorwise when both scale_invs hold one element; rowwise when a_scale_inv is [m] and
// b_scale_inv is [n] (then both operands must be e4m3: the layout cuBLASLt's outer-vector
// scaling and torch._scaled_mm's rowwise path take). Anything else is refused, naming both.
kernels::cuda::Fp8ScaleMode scale_mode(const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv,
                                       std::int64_t m, std::int64_t n, kernels::Fp8Format a_format,
                                       kernels::Fp8Format b_format, const at::Device& device) {
  for (const auto& [t, name] :
       {std::pair{&a_scale_inv, "a_scale_inv"}, std::pair{&b_scale_inv, "b_scale_inv"}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ampfuse.", kGemm, ": ", name,
                " must be a "
                "torch.float32 tensor, got ",
                t->scalar_type(), ".");
    TORCH_CHECK(t->device() == device, "ampfuse.", kGemm, ": ", name, " is on ", t->device(),
                " but must be on ", device, " (the device of a); move ", name, " to ", device, ".");
  }
  if (a_scale_inv.numel() == 1 && b_scale_inv.numel() == 1) {
    return kernels::cuda::Fp8ScaleMode::kTensorwise;
  }
  const bool rowwise = a_scale_inv.dim() == 1 && a_scale_inv.size(0) == m &&
                       b_scale_inv.dim() == 1 && b_scale_inv.size(0) == n;
  TORCH_CHECK(rowwise, "ampfuse.", kGemm, ": a_scale_inv has shape ", a_scale_inv.sizes(),
              " and b_scale_inv has shape ", b_scale_inv.sizes(),
              "; they must be either one "
              "element each (tensorwise scaling) or 1-D of m=",
              m, " and n=", n,
              " elements "
              "(rowwise scaling: one per row of a [m, k] and one per row of b [n, k]).");
  TORCH_CHECK(a_format == kernels::Fp8Format::kE4M3 && b_format == kernels::Fp8Format::kE4M3,
              "ampfuse.", kGemm,
              ": rowwise scales (a_scale_inv [m], b_scale_inv [n]) need both "
              "a and b in torch.float8_e4m3fn, got a ",
              a_format == kernels::Fp8Format::kE4M3 ? "e4m3fn" : "e5m2", " and b ",
              b_format == kernels::Fp8Format::kE4M3 ? "e4m3fn" : "e5m2",
              ". Quantize both "
              "rowwise operands to e4m3fn, or use one-element (tensorwise) scales for e5m2.");
  return kernels::cuda::Fp8ScaleMode::kRowwise;
}

// What the GPU computes: exact fp8 products summed in fp32, the sum times the scale_invs'
// product (one per output, or one per (row of a, row of b)), plus the bias, rounded once to
// out_dtype. The CPU kernel; on CUDA only for empty problems (m, n or k = 0).
at::Tensor emulated_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                         const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype, bool rowwise) {
  const std::int64_t m = a.size(0), n = b.size(0);
  at::Tensor out = at::mm(a.to(at::kFloat), b.to(at::kFloat).t());
  if (rowwise) {
    out.mul_(at::mul(a_scale_inv.view({m, 1}), b_scale_inv.view({1, n})));
  } else {
    out.mul_(at::mul(a_scale_inv.reshape({}), b_scale_inv.reshape({})));
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(out_dtype);
}

#ifdef AMPFUSE_WITH_CUDA
// `t` as a dense vector on a 16-byte boundary: itself when it is one (the usual case, no
// copy), else a fresh copy (the caching allocator's blocks are 512-byte aligned).
at::Tensor dense_aligned(const at::Tensor& t) {
  const at::Tensor dense = t.contiguous();
  if (reinterpret_cast<std::uintptr_t>(dense.data_ptr()) % 16 == 0) return dense;
  return dense.clone();
}
#endif

kernels::DType gemm_out_dtype(at::ScalarType out_dtype) {
  switch (out_dtype) {
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kFloat:
      return kernels::DType::kFloat32;
    default:
      TORCH_CHECK(false, "ampfuse.", kGemm,
                  ": out_dtype must be torch.bfloat16, torch.float16 "
                  "or torch.float32, got ",
                  out_dtype, ".");
  }
}

// fp8_gemm on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                    const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                    at::ScalarType out_dtype, bool use_fast_accum) {
  const kernels::Fp8Format a_format = fp8_format(kGemm, a.scalar_type(), "a");
  const kernels::Fp8Format b_format = fp8_format(kGemm, b.scalar_type(), "b");
  TORCH_CHECK(a_format == kernels::Fp8Format::kE4M3 || b_format == kernels::Fp8Format::kE4M3,
              "ampfuse.", kGemm,
              ": a and b are both float8_e5m2; cuBLASLt's FP8 GEMMs take at "
              "most one e5m2 operand. Quantize one of them (the weight or the activation) to "
              "float8_e4m3fn.");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "ampfuse.", kGemm,
              ": a and b must be 2-D, got "
              "shapes ",
              a.sizes(), " and ", b.sizes(), "; flatten leading dimensions first.");
  TORCH_CHECK(a.size(1) == b.size(1), "ampfuse.", kGemm, ": a is ", a.sizes(), " and b is ",
              b.sizes(),
              "; both hold K along dimension 1 (out = a @ b.T), so their sizes there "
              "must agree.");
  TORCH_CHECK(a.device() == b.device(), "ampfuse.", kGemm, ": a is on ", a.device(),
              " but b is on ", b.device(), "; move both to one device.");
  const std::int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  TORCH_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0, "ampfuse.", kGemm, ": m=", m, ", n=", n,
              ", k=", k,
              " must all be multiples of 16 (cuBLASLt's FP8 layout rule); pad the "
              "rows of a (e.g. the batch) with zeros up to a multiple of 16.");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "ampfuse.", kGemm,
              ": a and b must be "
              "row-major contiguous with K contiguous (the TN layout of FP8 GEMMs); pass "
              "a.contiguous() and b.contiguous() (for b = w.T, a transposed copy of w).");
  const kernels::cuda::Fp8ScaleMode mode =
      scale_mode(a_scale_inv, b_scale_inv, m, n, a_format, b_format, a.device());
  const bool rowwise = mode == kernels::cuda::Fp8ScaleMode::kRowwise;
  const kernels::DType out_kernel_dtype = gemm_out_dtype(out_dtype);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == out_dtype &&
                    bias->device() == a.device(),
                "ampfuse.", kGemm, ": bias must be a 1-D tensor of n=", n,
                " elements with "
                "dtype out_dtype (",
                out_dtype, ") on ", a.device(), ", got shape ", bias->sizes(), ", dtype ",
                bias->scalar_type(), " on ", bias->device(), ".");
  }
  if constexpr (kDevice == at::kCPU) {
    // use_fast_accum changes only how a GPU keeps its partial sums, so the emulation, which
    // is the fp32-accumulated reference, ignores it.
    (void)use_fast_accum;
    return emulated_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, rowwise);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const int device = a.device().index();
    const int capability = kernels::cuda::compute_capability(device);
    TORCH_CHECK_NOT_IMPLEMENTED(capability >= 89, "ampfuse.", kGemm, ": CUDA device ", device,
                                " has compute capability ", capability / 10, ".", capability % 10,
                                "; FP8 GEMMs need 8.9 or newer (Ada, Hopper, "
                                "Blackwell). Train this model without fp8, or on such a GPU.");
    // cuBLASLt's outer-vector (rowwise) scaling exists for Hopper (cuBLAS 12.9+); Ada has
    // tensorwise FP8 only (torch._scaled_mm has its own rowwise kernel there). Blackwell
    // (sm_100, sm_120) passes this check, but its cuBLASLt has no outer-vector kernels either
    // (torch excludes them, pytorch PRs #160693 and #161236; its heuristic answers
    // NOT_SUPPORTED, pytorch issue #192707): that refusal comes from the plan's heuristic query
    // as NotImplementedError, which the rowwise Linear's "auto" reads as "use torch._scaled_mm".
    TORCH_CHECK_NOT_IMPLEMENTED(!rowwise || capability >= 90, "ampfuse.", kGemm,
                                ": rowwise "
                                "scales need a GPU of compute capability 9.0 or newer "
                                "(cuBLASLt's outer-vector scaling); CUDA device ",
                                device, " has ", capability / 10, ".", capability % 10,
                                ". Use "
                                "one-element (tensorwise) scales on this GPU, or "
                                "torch._scaled_mm's rowwise path.");
    for (const at::Tensor* t : {&a, &b}) {
      TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 == 0, "ampfuse.", kGemm,
                  ": a and b must start on a 16-byte boundary (cuBLASLt's rule); pass a fresh "
                  "copy (t.clone()) instead of a view into another tensor.");
    }
    const c10::cuda::CUDAGuard guard(a.device());
    if (m == 0 || n == 0 || k == 0) {
      // Nothing for cuBLASLt to do, and it may refuse such layouts (k = 0 makes lda = 0): the
      // CPU's formula on this device (an empty output, or for k = 0 the empty sum times the
      // scales plus the bias), a few tiny launches. An empty batch (m = 0) reaches here from
      // a Linear as the forward's and the dgrad's m and as the wgrad's k.
      return emulated_gemm(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, rowwise);
    }
    at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
    // A strided 1-D scale vector (a view) is copied; contiguous ones (the usual case) are not.
    // So is one that does not start on a 16-byte boundary (a view at an offset): cuBLASLt
    // does not document the alignment its outer-vector kernels read the scales with.
    const at::Tensor a_scales = rowwise ? dense_aligned(a_scale_inv) : a_scale_inv;
    const at::Tensor b_scales = rowwise ? dense_aligned(b_scale_inv) : b_scale_inv;
    // cuBLASLt's FP8 kernels fuse a bias of the output's type for bf16 and fp16 outputs; for
    // an fp32 output they take a bf16 bias only (cuBLASLt's FP8 type table), so an fp32 bias
    // is added after, which keeps its bits.
    const bool fused_bias = bias.has_value() && out_dtype != at::kFloat;
    // The epilogue reads the bias as a dense vector: a strided view (bias[::2]) is copied. So is
    // a view that starts off a 16-byte boundary (bias[1:]): the plan's alignment is that of its
    // least aligned pointer, bias included, and below 16 bytes cuBLASLt has no FP8 kernel for
    // a and b either, so such a bias would make the whole GEMM a refusal.
    const at::Tensor fused_bias_values = fused_bias ? dense_aligned(*bias) : at::Tensor();
    const kernels::StreamHandle stream = current_stream(a.device());
    kernels::cuda::Fp8GemmArgs args{a.data_ptr(),
                                    a_format,
                                    b.data_ptr(),
                                    b_format,
                                    m,
                                    n,
                                    k,
                                    a_scales.data_ptr<float>(),
                                    b_scales.data_ptr<float>(),
                                    mode,
                                    use_fast_accum,
                                    fused_bias ? fused_bias_values.data_ptr() : nullptr,
                                    out.data_ptr(),
                                    out_kernel_dtype,
                                    device};
    // torch's cuBLASLt handle (one per thread and device) and its workspace for this handle
    // and the current stream: allocated once from the caching allocator and kept, so memory
    // stats and CUDA graphs see it, and shared with torch's own GEMMs on the stream (stream
    // order keeps the uses apart).
    const kernels::cuda::Fp8GemmContext context{at::cuda::getCurrentCUDABlasLtHandle(),
                                                at::cuda::getCUDABlasLtWorkspace(),
                                                at::cuda::getCUDABlasLtWorkspaceSize()};
    bool bias_done = false;
    try {
      bias_done = kernels::cuda::fp8_gemm(args, context, stream);
    } catch (const kernels::cuda::Fp8GemmUnsupported& refusal) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, refusal.what());
    }
    if (bias.has_value() && !bias_done) out.add_(*bias);
    return out;
#endif
  }
}

}  // namespace

OpKernels fp8_gemm_kernels() { return AMPFUSE_KERNELS(fp8_gemm); }

std::vector<std::int64_t> fp8_gemm_plan_stats() {
#ifdef AMPFUSE_WITH_CUDA
  const kernels::cuda::Fp8GemmPlanStats stats = kernels::cuda::fp8_gemm_plan_stats();
  return {stats.built, stats.reused, stats.evicted, stats.capacity};
#else
  return {0, 0, 0, 0};
#endif
}

}  // namespace ampfuse::ops
