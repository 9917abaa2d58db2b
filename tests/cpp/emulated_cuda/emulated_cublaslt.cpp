// The cuBLASLt stand-in of emulated_cublaslt.h: descriptors as plain structs, the heuristic as
// a check of cuBLASLt's FP8 rules, the matmul in double from the column-major definition.
#include "emulated_cublaslt.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ampfuse_emu::blaslt {
namespace {

struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale_type;
  std::int32_t trans_a = CUBLAS_OP_N;
  std::int32_t trans_b = CUBLAS_OP_N;
  std::int8_t fast_accum = 0;
  std::int32_t a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  std::int32_t b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  std::int32_t bias_type = -1;
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  const void* bias = nullptr;
};

struct Layout {
  cudaDataType type;
  std::uint64_t rows, cols;
  std::int64_t ld;
};

struct Preference {
  std::uint64_t workspace_bytes = 0;
  std::uint32_t alignment = 256;  // the smallest of the MIN_ALIGNMENT_*_BYTES set
};

// Marks an algorithm this stand-in's heuristic handed out.
constexpr std::uint64_t kAlgorithm = 0xa1f0'5e11'0000'0001ull;

Desc& desc_of(cublasLtMatmulDesc_t d) { return *reinterpret_cast<Desc*>(d); }
Layout& layout_of(cublasLtMatrixLayout_t l) { return *reinterpret_cast<Layout*>(l); }

bool is_fp8(cudaDataType t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

// Copies an attribute of exactly the documented size.
template <typename T>
cublasStatus_t read_attribute(T& into, const void* value, std::size_t bytes) {
  if (value == nullptr || bytes != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&into, value, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

// cuBLASLt's rules for an FP8 matmul of these descriptors (C must be D).
cublasStatus_t check_problem(const Desc& d, const Layout& a, const Layout& b, const Layout& c,
                             const Layout& out) {
  if (d.compute != CUBLAS_COMPUTE_32F || d.scale_type != CUDA_R_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // FP8 kernels take only "TN": A transposed, B not, so both have K as their rows.
  if (d.trans_a != CUBLAS_OP_T || d.trans_b != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!is_fp8(a.type) || !is_fp8(b.type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (out.type != CUDA_R_16BF && out.type != CUDA_R_16F && out.type != CUDA_R_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (a.rows != b.rows || out.rows != a.cols || out.cols != b.cols) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (c.type != out.type || c.rows != out.rows || c.cols != out.cols || c.ld != out.ld) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (const Layout* l : {&a, &b, &out}) {
    if (l->ld < static_cast<std::int64_t>(l->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (a.rows % 16 != 0 || a.ld % 16 != 0 || b.ld % 16 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool scalar = d.a_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F &&
                      d.b_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const bool outer = d.a_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F &&
                     d.b_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  if (!scalar && !outer) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d.a_scale == nullptr || d.b_scale == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (d.epilogue == CUBLASLT_EPILOGUE_BIAS) {
    // The bias has D's type, except that an fp32 D takes a bf16 bias.
    const std::int32_t want = out.type == CUDA_R_32F ? CUDA_R_16BF : out.type;
    if (d.bias_type != want) return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (d.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

double fp8_value(std::uint8_t code, cudaDataType type) {
  const __half_raw h =
      __nv_cvt_fp8_to_halfraw(code, type == CUDA_R_8F_E4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

double element(const void* base, std::int64_t i, cudaDataType type) {
  switch (type) {
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

void store(void* base, std::int64_t i, cudaDataType type, double v) {
  const auto f = static_cast<float>(v);
  switch (type) {
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(f);
      break;
    case CUDA_R_16F:
      static_cast<__half*>(base)[i] = __float2half_rn(f);
      break;
    default:
      static_cast<float*>(base)[i] = f;
      break;
  }
}

}  // namespace

Behaviour& behaviour() {
  static Behaviour b;
  return b;
}

const char* get_status_string(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_(emulated other)";
  }
}

std::size_t get_version() { return 130000; }  // "13.0.0"

cublasStatus_t desc_create(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                           cudaDataType_t scale_type) {
  auto* d = new Desc;
  d->compute = compute;
  d->scale_type = scale_type;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t desc_destroy(cublasLtMatmulDesc_t desc) {
  delete &desc_of(desc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t desc_set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                        const void* value, std::size_t bytes) {
  Desc& d = desc_of(desc);
  switch (attribute) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return read_attribute(d.trans_a, value, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return read_attribute(d.trans_b, value, bytes);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
      return read_attribute(d.fast_accum, value, bytes);
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE: {
      if (behaviour().no_outer_vector_scales) return CUBLAS_STATUS_INVALID_VALUE;
      std::int32_t& mode =
          attribute == CUBLASLT_MATMUL_DESC_A_SCALE_MODE ? d.a_scale_mode : d.b_scale_mode;
      return read_attribute(mode, value, bytes);
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return read_attribute(d.epilogue, value, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return read_attribute(d.bias_type, value, bytes);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return read_attribute(d.a_scale, value, bytes);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return read_attribute(d.b_scale, value, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return read_attribute(d.bias, value, bytes);
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;  // not used by ampfuse: not emulated
  }
}

cublasStatus_t layout_create(cublasLtMatrixLayout_t* layout, cudaDataType type, std::uint64_t rows,
                             std::uint64_t cols, std::int64_t ld) {
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t layout_destroy(cublasLtMatrixLayout_t layout) {
  delete &layout_of(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t preference_create(cublasLtMatmulPreference_t* preference) {
  *preference = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t preference_destroy(cublasLtMatmulPreference_t preference) {
  delete reinterpret_cast<Preference*>(preference);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t preference_set(cublasLtMatmulPreference_t preference,
                              cublasLtMatmulPreferenceAttributes_t attribute, const void* value,
                              std::size_t bytes) {
  auto& p = *reinterpret_cast<Preference*>(preference);
  switch (attribute) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return read_attribute(p.workspace_bytes, value, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
      std::uint32_t alignment = 0;
      const cublasStatus_t status = read_attribute(alignment, value, bytes);
      if (status == CUBLAS_STATUS_SUCCESS) p.alignment = std::min(p.alignment, alignment);
      return status;
    }
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t heuristic(cublasLtHandle_t, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                         cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                         cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t preference,
                         int requested, cublasLtMatmulHeuristicResult_t* results, int* found) {
  ++behaviour().heuristic_queries;
  *found = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  const Desc& op = desc_of(desc);
  const cublasStatus_t status =
      check_problem(op, layout_of(a), layout_of(b), layout_of(c), layout_of(d));
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (op.epilogue == CUBLASLT_EPILOGUE_BIAS && behaviour().no_bias_algorithm) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].algo.data[0] = kAlgorithm;
  // The algorithm is one for pointers aligned as the preference says (matmul checks them).
  results[0].algo.data[1] = reinterpret_cast<const Preference*>(preference)->alignment;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t matmul(cublasLtHandle_t, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                      cublasLtMatrixLayout_t a_layout, const void* b,
                      cublasLtMatrixLayout_t b_layout, const void* beta, const void* c,
                      cublasLtMatrixLayout_t c_layout, void* d, cublasLtMatrixLayout_t d_layout,
                      const cublasLtMatmulAlgo_t* algo, void*, std::size_t, cudaStream_t) {
  ++behaviour().launches;
  const Desc& op = desc_of(desc);
  const Layout& la = layout_of(a_layout);
  const Layout& lb = layout_of(b_layout);
  const Layout& ld = layout_of(d_layout);
  if (algo == nullptr || algo->data[0] != kAlgorithm) return CUBLAS_STATUS_INVALID_VALUE;
  const cublasStatus_t status = check_problem(op, la, lb, layout_of(c_layout), ld);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const std::uint64_t alignment = algo->data[1];
  for (const void* p : {a, b, static_cast<const void*>(d),
                        op.epilogue == CUBLASLT_EPILOGUE_BIAS ? op.bias : nullptr}) {
    if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (behaviour().refuse_launch) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (op.epilogue == CUBLASLT_EPILOGUE_BIAS && behaviour().refuse_bias_launch) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const float alpha_value = *static_cast<const float*>(alpha);
  const float beta_value = *static_cast<const float*>(beta);
  if (beta_value != 0.0f && c != d) return CUBLAS_STATUS_NOT_SUPPORTED;  // not emulated
  const auto* a_codes = static_cast<const std::uint8_t*>(a);
  const auto* b_codes = static_cast<const std::uint8_t*>(b);
  const auto* a_scale = static_cast<const float*>(op.a_scale);
  const auto* b_scale = static_cast<const float*>(op.b_scale);
  const bool outer = op.a_scale_mode == CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const auto m = static_cast<std::int64_t>(ld.rows);
  const auto n = static_cast<std::int64_t>(ld.cols);
  const auto k = static_cast<std::int64_t>(la.rows);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t i = 0; i < m; ++i) {
      // op(A)[i, p] = A[p, i] (A is K x M), op(B)[p, j] = B[p, j] (B is K x N).
      double sum = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        sum +=
            fp8_value(a_codes[p + i * la.ld], la.type) * fp8_value(b_codes[p + j * lb.ld], lb.type);
      }
      const double scale_a = outer ? a_scale[i] : a_scale[0];
      const double scale_b = outer ? b_scale[j] : b_scale[0];
      double v = alpha_value * (sum * scale_a * scale_b);
      if (beta_value != 0.0f) v += beta_value * element(d, i + j * ld.ld, ld.type);
      if (op.epilogue == CUBLASLT_EPILOGUE_BIAS) {
        v += element(op.bias, i, static_cast<cudaDataType>(op.bias_type));
      }
      store(d, i + j * ld.ld, ld.type, v);
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace ampfuse_emu::blaslt
