// Launchers of the FP8 CUDA work: the fused cast + amax, the multi-tensor delayed-scaling
// update and the cuBLASLt FP8 GEMM. Plain pointers and a stream, as in cuda_kernels.h; no
// torch and no CUDA headers. Nothing here synchronizes with the host; failures throw
// std::runtime_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "dtype.h"
#include "fp8_math.h"

namespace ampfuse::kernels::cuda {

// dst[i] = fp8 code of src[i] * *scale saturated to the format's range (fp8_math.h), and
// *amax = max(*amax, max |src|) with nan propagating. *amax must hold a value >= 0 or nan.
void fp8_cast_amax(const TensorRef& src, std::uint8_t* dst, const float* scale, float* amax,
                   Fp8Format format, StreamHandle stream);

// update_fp8_scale (fp8_math.h) for every state, in as few launches as the kernel-argument
// table allows (one for up to kFp8StatesPerLaunch states). `skip` is a device flag (a
// found_inf: nonzero drops this step's amaxes) or null.
void fp8_update_scales(const std::vector<Fp8ScaleState>& states, float margin_factor, bool use_max,
                       const float* skip, StreamHandle stream);

// major * 10 + minor of a device (89 for Ada, 90 for Hopper). Asked of the driver once per
// device and process (the op layer checks it on every FP8 GEMM), then remembered.
int compute_capability(int device);

// How fp8_gemm's scale_invs apply: one each for all of out (tensorwise), or a_scale_inv[i] for
// row i of a and b_scale_inv[j] for row j of b (rowwise; cuBLASLt's outer-vector scaling).
enum class Fp8ScaleMode : std::int8_t { kTensorwise, kRowwise };

// out[m, n] = (a[m, :] . b[n, :]) * scales (+ bias[n]) with a and b row-major fp8 (K
// contiguous, the "TN" layout cuBLASLt's FP8 kernels take). out is bf16, fp16 or fp32
// (row-major); bias, when given, has out's type and out is bf16 or fp16 (for an fp32 out
// cuBLASLt's FP8 kernels take a bf16 bias only, so the op layer adds an fp32 bias itself).
// m, n, k are multiples of 16, a and b 16-byte aligned and not both e5m2, and rowwise scales
// have m and n elements with both operands e4m3: the op layer checks all of it.
// fast_accum: cuBLASLt's FP8 fast accumulation (partial sums not promoted to full fp32 along
// K; faster, less accurate).
struct Fp8GemmArgs {
  const void* a;
  Fp8Format a_format;
  const void* b;
  Fp8Format b_format;
  std::int64_t m, n, k;
  const float* a_scale_inv;
  const float* b_scale_inv;
  Fp8ScaleMode scale_mode;
  bool fast_accum;
  const void* bias;
  void* out;
  DType out_dtype;
  int device;
};

// The cuBLASLt handle (a cublasLtHandle_t; opaque here so that this header needs no CUDA
// header) and the workspace the call may use, both owned by the caller (the op layer passes
// torch's: its per-thread handle and its persistent per-(handle, stream) workspace from the
// caching allocator).
struct Fp8GemmContext {
  void* blaslt_handle;
  void* workspace;
  std::size_t workspace_bytes;
};

// Runs the GEMM on `stream`. The matmul descriptor, the three layouts and the algorithm
// cuBLASLt's heuristic picks are built once per problem (device, m, n, k, formats, scale
// mode, fast_accum, bias, out dtype, pointer alignment, workspace size) and cached per host
// thread (a cached plan is only touched by its own thread), up to a fixed number of plans per
// thread, the least recently used dropped first (the key holds m, so variable sequence lengths
// would otherwise grow the cache without end). Returns whether the bias was fused into the
// epilogue; when cuBLASLt has no kernel with the bias epilogue for a problem (its heuristic finds
// none, or it refuses the first launch; possible for rowwise scaling, whose kernels are newer), the
// plan runs without it from then on and returns false, and the caller adds the bias.
//
// Throws Fp8GemmUnsupported (below) when this cuBLASLt cannot run the problem on this device,
// and std::runtime_error for any other failure.
bool fp8_gemm(const Fp8GemmArgs& args, const Fp8GemmContext& context, StreamHandle stream);

// "This cuBLASLt has no kernel for this problem on this device", as opposed to a failure: the
// heuristic found no algorithm, cuBLASLt refused the scale mode or the plan's first launch
// (CUBLAS_STATUS_NOT_SUPPORTED; for rowwise scales, whose outer-vector kernels are newer and
// have never been seen to work here, any refusal before a first successful launch). The op
// layer turns it into torch's NotImplementedError, which ampfuse.fp8's rowwise path reads as
// "use torch._scaled_mm instead".
class Fp8GemmUnsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Counters of fp8_gemm's plan cache over the process (all threads): plans built (one
// heuristic query each), calls that found their plan cached, and plans evicted (dropped as the
// least recently used of a full per-thread cache); and the number of plans one thread's cache
// holds at most. Tests read them through the op fp8_gemm_plan_stats, in this order.
struct Fp8GemmPlanStats {
  std::int64_t built;
  std::int64_t reused;
  std::int64_t evicted;
  std::int64_t capacity;
};
Fp8GemmPlanStats fp8_gemm_plan_stats();

// out (cols x rows, row-major) = the transpose of in (rows x cols, row-major), one-byte FP8
// codes moved as they are (csrc/kernels/fp8_transpose.cu).
void fp8_transpose(const std::uint8_t* in, std::uint8_t* out, std::int64_t rows, std::int64_t cols,
                   StreamHandle stream);

// Current scaling of one tensor (fp8_tensor_scale): *amax = max |src| with nan winning (the
// previous value of *amax is ignored), then *scale = current_fp8_scale(*amax, fp8_max,
// margin_factor) (fp8_math.h) and *scale_inv = 1 / *scale, all on the device: one reduction
// launch (after an async zero of *amax) and one single-thread launch, no host sync.
void fp8_tensor_scale(const TensorRef& src, float* amax, float* scale, float* scale_inv,
                      float fp8_max, float margin_factor, StreamHandle stream);

// One pass over src [rows, cols] (row-major, fp32/fp16/bf16): out [rows, cols] and out_t
// [cols, rows] get the fp8 codes of src * *scale, *amax = max(*amax, max |src|) with nan
// winning, and, when dbias is not null, dbias[c] = sum of column c in fp32. dbias needs
// dbias_workspace of fp8_dbias_workspace_floats(rows, cols) floats (per-tile column sums,
// reduced in a fixed order by a second launch: dbias is the same bits on every run).
struct Fp8CastTransposeArgs {
  const void* src;
  DType src_dtype;
  std::int64_t rows, cols;
  const float* scale;
  float* amax;
  std::uint8_t* out;
  std::uint8_t* out_t;
  float* dbias;
  float* dbias_workspace;
  Fp8Format format;
};
void fp8_cast_transpose(const Fp8CastTransposeArgs& args, StreamHandle stream);
std::int64_t fp8_dbias_workspace_floats(std::int64_t rows, std::int64_t cols);

// Rowwise current scaling of src [rows, cols] (no margin). transpose == false: out [rows,
// cols], scale_inv [rows], one block per row. transpose == true: out [cols, rows] = the codes
// of src.T with one scale per column of src, scale_inv [cols]; needs column_amax_workspace of
// cols uint32 (a column-amax launch, then a tiled cast + transpose launch).
void fp8_quantize_rowwise(const void* src, DType src_dtype, std::int64_t rows, std::int64_t cols,
                          bool transpose, std::uint8_t* out, float* scale_inv,
                          std::uint32_t* column_amax_workspace, Fp8Format format,
                          StreamHandle stream);

}  // namespace ampfuse::kernels::cuda
