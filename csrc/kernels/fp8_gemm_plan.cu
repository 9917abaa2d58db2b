// The plan of an FP8 GEMM problem (fp8_gemm_plan.h): descriptors, layouts, the heuristic's
// algorithm, and cuBLASLt's refusals. Host code only.
#include <cuda_runtime.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "fp8_gemm_plan.h"

namespace ampfuse::kernels::cuda::gemm_plan {
namespace {

cudaDataType_t fp8_type(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

cudaDataType_t out_type(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

const char* out_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    default:
      return "float32";
  }
}

// The cuBLASLt loaded at run time (it may be older than the headers built against), for the
// refusals: "cuBLASLt 12.8.4".
std::string library_version() {
  const std::size_t v = cublasLtGetVersion();
  return "cuBLASLt " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

struct PreferenceOwner {
  cublasLtMatmulPreference_t preference = nullptr;
  ~PreferenceOwner() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
  }
};

}  // namespace

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("ampfuse.fp8_gemm: ") + what +
                             " failed: " + cublasLtGetStatusString(status));
  }
}

std::uint32_t common_alignment(const Fp8GemmArgs& args) {
  std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(args.a) |
                        reinterpret_cast<std::uintptr_t>(args.b) |
                        reinterpret_cast<std::uintptr_t>(args.out) |
                        reinterpret_cast<std::uintptr_t>(args.bias) | std::uintptr_t{256};
  return static_cast<std::uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

std::string problem(const PlanKey& key) {
  return "m=" + std::to_string(key.m) + ", n=" + std::to_string(key.n) +
         ", k=" + std::to_string(key.k) + ", " +
         (key.scale_mode == Fp8ScaleMode::kRowwise ? "rowwise" : "tensorwise") +
         " scales, out_dtype " + out_name(key.out_dtype) +
         ", use_fast_accum=" + (key.fast_accum ? "True" : "False") + ", pointers aligned to " +
         std::to_string(key.alignment) + " bytes";
}

[[noreturn]] void unsupported(const PlanKey& key, const std::string& why) {
  throw Fp8GemmUnsupported("ampfuse.fp8_gemm: " + library_version() + " cannot run " +
                           problem(key) + " on CUDA device " + std::to_string(key.device) + ": " +
                           why + ". " + kRequirements);
}

void describe(Plan& plan, const PlanKey& key, bool with_bias) {
  if (plan.op) {
    cublasLtMatmulDescDestroy(plan.op);
    plan.op = nullptr;
  }
  check(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  const cublasOperation_t transposed = CUBLAS_OP_T;
  const cublasOperation_t plain = CUBLAS_OP_N;
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, transposed, "setting TRANSA");
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, plain, "setting TRANSB");
  const std::int8_t fast_accum = key.fast_accum ? 1 : 0;
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum, "setting FAST_ACCUM");
  if (key.scale_mode == Fp8ScaleMode::kRowwise) {
    // A cuBLASLt older than 12.9 does not know the attribute or the mode: it cannot do
    // rowwise scales at all, which is a refusal, not a failure.
    const std::int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    for (const auto attribute :
         {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE}) {
      const cublasStatus_t status =
          cublasLtMatmulDescSetAttribute(plan.op, attribute, &outer, sizeof(outer));
      if (status != CUBLAS_STATUS_SUCCESS) {
        unsupported(key, std::string("setting the outer-vector scale mode gave ") +
                             cublasLtGetStatusString(status));
      }
    }
  }
  if (with_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    // The bias has the output's type (bf16 or fp16: the op layer never fuses an fp32 bias).
    const std::int32_t bias_type = out_type(key.out_dtype);
    set_attribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, "setting the bias epilogue");
    set_attribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type, "setting the bias type");
  }
}

// The pointer attributes of the descriptor as the heuristic sees them (launch() sets each
// call's own before it runs). cuBLASLt's header on CUBLASLT_MATMUL_DESC_BIAS_POINTER: routines
// that do not dereference it, "like cublasLtMatmulAlgoGetHeuristic() depend on its value to
// determine expected pointer alignment". Left null (aligned to everything), the heuristic may
// pick a kernel that needs a more aligned bias than a later call of the same plan passes. Every
// call of a plan has its bias aligned to at least key.alignment (common_alignment includes
// it), so the heuristic gets an address in the bias's neighbourhood aligned to exactly that;
// it is never read. The scale pointers are the first call's real ones, set before the query
// as in NVIDIA's FP8 cuBLASLt sample, so that no algorithm is chosen for "no scales".
void describe_pointers(Plan& plan, const PlanKey& key, const Fp8GemmArgs& args) {
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.b_scale_inv,
                "setting A's scale");
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.a_scale_inv,
                "setting B's scale");
  if (plan.fused_bias) {
    const std::uintptr_t bias = reinterpret_cast<std::uintptr_t>(args.bias);
    const void* alignment_hint =
        reinterpret_cast<const void*>((bias & ~std::uintptr_t{255}) | key.alignment);
    set_attribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, alignment_hint,
                  "setting the bias alignment for the heuristic");
  }
}

cublasStatus_t pick_algorithm(Plan& plan, const PlanKey& key, cublasLtHandle_t handle) {
  PreferenceOwner p;
  check(cublasLtMatmulPreferenceCreate(&p.preference), "cublasLtMatmulPreferenceCreate");
  const std::size_t workspace_bytes = key.workspace_bytes;
  check(cublasLtMatmulPreferenceSetAttribute(p.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes)),
        "setting the workspace size");
  for (const auto attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    check(cublasLtMatmulPreferenceSetAttribute(p.preference, attribute, &key.alignment,
                                               sizeof(key.alignment)),
          "setting the alignment");
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.op, plan.a, plan.b, plan.out, plan.out, p.preference, 1, &heuristic, &found);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan.algo = heuristic.algo;
  return CUBLAS_STATUS_SUCCESS;
}

std::string no_algorithm(cublasStatus_t status, const char* what) {
  return std::string("its heuristic has no algorithm for it") + what + " (" +
         cublasLtGetStatusString(status) + ")";
}

std::unique_ptr<Plan> build_plan(const PlanKey& key, const Fp8GemmArgs& args,
                                 cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  const auto k = static_cast<std::uint64_t>(key.k);
  const auto m = static_cast<std::uint64_t>(key.m);
  const auto n = static_cast<std::uint64_t>(key.n);
  check(cublasLtMatrixLayoutCreate(&plan->a, fp8_type(key.b_format), k, n, key.k),
        "creating A's layout");
  check(cublasLtMatrixLayoutCreate(&plan->b, fp8_type(key.a_format), k, m, key.k),
        "creating B's layout");
  check(cublasLtMatrixLayoutCreate(&plan->out, out_type(key.out_dtype), n, m, key.n),
        "creating D's layout");
  describe(*plan, key, key.bias);
  plan->fused_bias = key.bias;
  describe_pointers(*plan, key, args);
  cublasStatus_t status = pick_algorithm(*plan, key, handle);
  if (status == CUBLAS_STATUS_SUCCESS) return plan;
  if (key.bias) {
    // No kernel with the bias epilogue: run the GEMM alone; the caller adds the bias.
    describe(*plan, key, false);
    plan->fused_bias = false;
    describe_pointers(*plan, key, args);
    status = pick_algorithm(*plan, key, handle);
    if (status == CUBLAS_STATUS_SUCCESS) return plan;
  }
  unsupported(key, no_algorithm(status, ""));
}

}  // namespace ampfuse::kernels::cuda::gemm_plan
