// An FP8 GEMM problem as cuBLASLt sees it: the plan (descriptors, layouts and the chosen
// algorithm) that fp8_gemm.cu builds once per problem and keeps, and cuBLASLt's refusals turned
// into Fp8GemmUnsupported. Host code only; fp8_gemm.cu says how the row-major problem maps
// onto cuBLASLt's column-major "TN" layout, and keeps the plans.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"

namespace ampfuse::kernels::cuda::gemm_plan {

// Throws std::runtime_error naming `what` unless cuBLASLt returned success.
void check(cublasStatus_t status, const char* what);

// The largest power of two, up to 256 (cuBLASLt's default assumption), that divides every
// address: the heuristic is told it, so the algorithm it picks accepts these pointers.
std::uint32_t common_alignment(const Fp8GemmArgs& args);

// Everything the descriptors and the algorithm depend on.
struct PlanKey {
  int device;
  std::int64_t m, n, k;
  Fp8Format a_format, b_format;
  Fp8ScaleMode scale_mode;
  bool fast_accum;
  bool bias;
  DType out_dtype;
  std::uint32_t alignment;
  std::size_t workspace_bytes;

  bool operator==(const PlanKey& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && a_format == o.a_format &&
           b_format == o.b_format && scale_mode == o.scale_mode && fast_accum == o.fast_accum &&
           bias == o.bias && out_dtype == o.out_dtype && alignment == o.alignment &&
           workspace_bytes == o.workspace_bytes;
  }
};

struct PlanKeyHash {
  std::size_t operator()(const PlanKey& key) const {
    std::size_t h = std::hash<std::int64_t>()(key.m);
    const auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    mix(std::hash<std::int64_t>()(key.n));
    mix(std::hash<std::int64_t>()(key.k));
    mix(static_cast<std::size_t>(key.device));
    mix((static_cast<std::size_t>(key.a_format) << 0) |
        (static_cast<std::size_t>(key.b_format) << 2) |
        (static_cast<std::size_t>(key.scale_mode) << 4) | (std::size_t{key.fast_accum} << 6) |
        (std::size_t{key.bias} << 7) | (static_cast<std::size_t>(key.out_dtype) << 8));
    mix(key.alignment);
    mix(key.workspace_bytes);
    return h;
  }
};

// The problem in words, for errors.
std::string problem(const PlanKey& key);

inline constexpr const char* kRequirements =
    "FP8 GEMMs need an sm_89 or newer GPU (rowwise scales: cuBLASLt has them for Hopper, sm_90, "
    "not for Blackwell) and a CUDA 12.9 or newer cuBLAS. Try tensorwise scales or another "
    "out_dtype.";

// Throws Fp8GemmUnsupported: this cuBLASLt cannot run `key` on its device, because `why`.
[[noreturn]] void unsupported(const PlanKey& key, const std::string& why);

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                   const T& value, const char* what) {
  check(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), what);
}

// One problem's descriptors and algorithm. The pointer attributes (scales, bias) are set
// before each launch.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fused_bias = false;
  bool launched = false;  // cuBLASLt has accepted a launch of this plan

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The matmul descriptor of `key`, with the bias epilogue when `with_bias`.
void describe(Plan& plan, const PlanKey& key, bool with_bias);

// The scale and bias pointer attributes the heuristic needs to see (fp8_gemm_plan.cu: why the
// bias gets an alignment hint, not its address).
void describe_pointers(Plan& plan, const PlanKey& key, const Fp8GemmArgs& args);

// Puts the heuristic's first algorithm for the plan's descriptors into the plan and returns
// CUBLAS_STATUS_SUCCESS; when it has none, the heuristic's status (CUBLAS_STATUS_NOT_SUPPORTED
// when it answered but found nothing), which the refusal quotes: an INVALID_VALUE there points
// at the descriptors, not at the GPU.
cublasStatus_t pick_algorithm(Plan& plan, const PlanKey& key, cublasLtHandle_t handle);

// The refusal's reason when the heuristic found nothing (`what`: for which variant).
std::string no_algorithm(cublasStatus_t status, const char* what);

// A new plan for `key`: with the bias epilogue where the heuristic has an algorithm for it,
// else without (the caller then adds the bias); Fp8GemmUnsupported when it has none at all.
std::unique_ptr<Plan> build_plan(const PlanKey& key, const Fp8GemmArgs& args,
                                 cublasLtHandle_t handle);

// Runs `body`; for rowwise scales turns any cuBLASLt refusal it throws into
// Fp8GemmUnsupported. Rowwise (outer-vector) scaling is new in cuBLASLt and is only ever
// described or launched here by a plan that has not yet run on this device, so whatever
// cuBLASLt refuses then means it cannot run the problem here.
template <typename Body>
void refusals_of_rowwise(const PlanKey& key, Body&& body) {
  try {
    body();
  } catch (const Fp8GemmUnsupported&) {
    throw;
  } catch (const std::runtime_error& error) {
    if (key.scale_mode != Fp8ScaleMode::kRowwise) throw;
    unsupported(key, error.what());
  }
}

}  // namespace ampfuse::kernels::cuda::gemm_plan
