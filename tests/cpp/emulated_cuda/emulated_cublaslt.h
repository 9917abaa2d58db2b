// A stand-in for cuBLASLt, for running fp8_gemm.cu's host code (its descriptors, layouts,
// scale and bias attributes, plan cache and refusal handling) on a machine without a GPU:
// force-included after emulated_cuda.h when fp8_gemm.cu is compiled for the CPU.
//
// It does what cuBLASLt's documentation says a matmul does, written from the documentation and
// not from fp8_gemm.cu: column-major layouts, D = op(A) * op(B) with op from TRANSA / TRANSB,
// scalar scales or (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) a vector of M scales for A and
// of N for B, the bias epilogue adding bias[i] to row i of D, D converted to its type. It holds
// every attribute to the size the header documents, and it refuses what cuBLASLt's FP8 kernels
// refuse (anything but "TN", e5m2 times e5m2, a K not a multiple of 16) and a launch whose
// pointers are less aligned than the preference its algorithm was chosen under. Tests can make
// it refuse more (Behaviour), as an older or a different cuBLASLt would. It sums in double and
// ignores FAST_ACCUM: what it checks is where the numbers go, not cuBLASLt's rounding.
#pragma once

#include <cublasLt.h>

#include <cstdint>

namespace ampfuse_emu::blaslt {

// What the stand-in refuses beyond cuBLASLt's rules, and what it counts.
struct Behaviour {
  bool no_bias_algorithm = false;   // the heuristic finds nothing when the bias epilogue is on
  bool refuse_bias_launch = false;  // cublasLtMatmul returns NOT_SUPPORTED with the bias epilogue
  bool no_outer_vector_scales = false;  // setting A_/B_SCALE_MODE gives INVALID_VALUE
  bool refuse_launch = false;           // every cublasLtMatmul returns NOT_SUPPORTED
  int heuristic_queries = 0;
  int launches = 0;
};
Behaviour& behaviour();

const char* get_status_string(cublasStatus_t status);
std::size_t get_version();
cublasStatus_t desc_create(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                           cudaDataType_t scale_type);
cublasStatus_t desc_destroy(cublasLtMatmulDesc_t desc);
cublasStatus_t desc_set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                        const void* value, std::size_t bytes);
cublasStatus_t layout_create(cublasLtMatrixLayout_t* layout, cudaDataType type, std::uint64_t rows,
                             std::uint64_t cols, std::int64_t ld);
cublasStatus_t layout_destroy(cublasLtMatrixLayout_t layout);
cublasStatus_t preference_create(cublasLtMatmulPreference_t* preference);
cublasStatus_t preference_destroy(cublasLtMatmulPreference_t preference);
cublasStatus_t preference_set(cublasLtMatmulPreference_t preference,
                              cublasLtMatmulPreferenceAttributes_t attribute, const void* value,
                              std::size_t bytes);
cublasStatus_t heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                         cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                         cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                         cublasLtMatmulPreference_t preference, int requested,
                         cublasLtMatmulHeuristicResult_t* results, int* found);
cublasStatus_t matmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                      const void* a, cublasLtMatrixLayout_t a_layout, const void* b,
                      cublasLtMatrixLayout_t b_layout, const void* beta, const void* c,
                      cublasLtMatrixLayout_t c_layout, void* d, cublasLtMatrixLayout_t d_layout,
                      const cublasLtMatmulAlgo_t* algo, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace ampfuse_emu::blaslt

#define cublasLtGetStatusString ::ampfuse_emu::blaslt::get_status_string
#define cublasLtGetVersion ::ampfuse_emu::blaslt::get_version
#define cublasLtMatmulDescCreate ::ampfuse_emu::blaslt::desc_create
#define cublasLtMatmulDescDestroy ::ampfuse_emu::blaslt::desc_destroy
#define cublasLtMatmulDescSetAttribute ::ampfuse_emu::blaslt::desc_set
#define cublasLtMatrixLayoutCreate ::ampfuse_emu::blaslt::layout_create
#define cublasLtMatrixLayoutDestroy ::ampfuse_emu::blaslt::layout_destroy
#define cublasLtMatmulPreferenceCreate ::ampfuse_emu::blaslt::preference_create
#define cublasLtMatmulPreferenceDestroy ::ampfuse_emu::blaslt::preference_destroy
#define cublasLtMatmulPreferenceSetAttribute ::ampfuse_emu::blaslt::preference_set
#define cublasLtMatmulAlgoGetHeuristic ::ampfuse_emu::blaslt::heuristic
#define cublasLtMatmul ::ampfuse_emu::blaslt::matmul
