// The FP8 GEMM through cuBLASLt. Only host code: cuBLASLt picks and runs the kernel.
//
// Layout: cuBLASLt is column-major and its FP8 kernels take only "TN" (A transposed, B
// not), i.e. both operands with K contiguous. Our row-major out[m, n] = a[m, :] . b[n, :]
// is, column-major, out^T (n x m) = b (k x n)^T * a (k x m): cuBLASLt's A is our b and its B
// is our a, so its A scale is b's and its B scale is a's.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"

namespace ampfuse::kernels::cuda {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("ampfuse.fp8_gemm: ") + what + " failed: " +
                             cublasLtGetStatusString(status));
  }
}

// One handle for the process: a cuBLASLt handle is not tied to a device or a stream and may
// be used from several threads.
cublasLtHandle_t handle() {
  static std::once_flag once;
  static cublasLtHandle_t h = nullptr;
  std::call_once(once, [] { check(cublasLtCreate(&h), "cublasLtCreate"); });
  return h;
}

cudaDataType_t fp8_type(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

// Owns the cuBLASLt descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, out = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                   const T& value, const char* what) {
  check(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), what);
}

}  // namespace

void fp8_gemm(const Fp8GemmArgs& args, StreamHandle stream) {
  const cudaDataType_t out_type = args.out_dtype == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  Descriptors d;
  check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transposed = CUBLAS_OP_T;
  const cublasOperation_t plain = CUBLAS_OP_N;
  set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, transposed, "setting TRANSA");
  set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, plain, "setting TRANSB");
  set_attribute(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.b_scale_inv, "setting A's scale");
  set_attribute(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.a_scale_inv, "setting B's scale");
  // Fast accumulation stays off (the default): with it the tensor cores keep partial sums in
  // reduced precision, and the result would drift from the fp32 CPU emulation.
  if (args.bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    set_attribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, "setting the bias epilogue");
    set_attribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type, "setting the bias type");
    set_attribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias, "setting the bias");
  }
  const auto k = static_cast<std::uint64_t>(args.k);
  const auto m = static_cast<std::uint64_t>(args.m);
  const auto n = static_cast<std::uint64_t>(args.n);
  check(cublasLtMatrixLayoutCreate(&d.a, fp8_type(args.b_format), k, n, args.k),
        "creating A's layout");
  check(cublasLtMatrixLayoutCreate(&d.b, fp8_type(args.a_format), k, m, args.k),
        "creating B's layout");
  check(cublasLtMatrixLayoutCreate(&d.out, out_type, n, m, args.n), "creating D's layout");

  check(cublasLtMatmulPreferenceCreate(&d.preference), "cublasLtMatmulPreferenceCreate");
  const std::size_t workspace_bytes = args.workspace_bytes;
  check(cublasLtMatmulPreferenceSetAttribute(d.preference,
                                             CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes)),
        "setting the workspace size");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(handle(), d.op, d.a, d.b, d.out, d.out, d.preference, 1,
                                       &heuristic, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) {
    throw std::runtime_error(
        "ampfuse.fp8_gemm: cuBLASLt has no FP8 kernel for this problem (m=" +
        std::to_string(args.m) + ", n=" + std::to_string(args.n) + ", k=" +
        std::to_string(args.k) + "); FP8 GEMMs need an sm_89 or newer GPU and a CUDA 12 or "
        "newer cuBLAS.");
  }
  const float alpha = 1.0f;
  const float beta = 0.0f;  // C is D's buffer and is not read
  check(cublasLtMatmul(handle(), d.op, &alpha, args.b, d.a, args.a, d.b, &beta, args.out, d.out,
                       args.out, d.out, &heuristic.algo, args.workspace, workspace_bytes,
                       reinterpret_cast<cudaStream_t>(stream)),
        "cublasLtMatmul");
}

}  // namespace ampfuse::kernels::cuda
