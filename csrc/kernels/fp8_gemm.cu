// The FP8 GEMM through cuBLASLt. Only host code: cuBLASLt picks and runs the kernel.
//
// Layout: cuBLASLt is column-major and its FP8 kernels take only "TN" (A transposed, B
// not), i.e. both operands with K contiguous. Our row-major out[m, n] = a[m, :] . b[n, :]
// is, column-major, out^T (n x m) = b (k x n)^T * a (k x m): cuBLASLt's A is our b and its B
// is our a, so its A scale is b's and its B scale is a's (for rowwise scaling: cuBLASLt's A
// scale vector has its M = our n elements, its B scale vector its N = our m elements), and
// its per-row-of-D bias is our per-column bias.
//
// Plans: building the descriptors and asking the heuristic costs far more host time than the
// launch itself, and this runs three times per FP8 Linear per step with a handful of shapes,
// so each problem's plan is built once and kept. The scale and bias pointers change per call
// and are attributes of the matmul descriptor, so a plan is set and launched by one thread
// only: the cache is per host thread (the autograd engine's backward thread gets its own), and
// no lock is taken on the hot path. The key holds m (the batch's tokens), so variable sequence
// lengths make new keys without end: the cache is bounded (kPlanCacheCapacity, below) and
// drops its least recently used plan when full.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"
#include "lru_cache.h"

namespace ampfuse::kernels::cuda {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("ampfuse.fp8_gemm: ") + what +
                             " failed: " + cublasLtGetStatusString(status));
  }
}

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

// The largest power of two, up to 256 (cuBLASLt's default assumption), that divides every
// address: the heuristic is told it, so the algorithm it picks accepts these pointers.
std::uint32_t common_alignment(const Fp8GemmArgs& args) {
  std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(args.a) |
                        reinterpret_cast<std::uintptr_t>(args.b) |
                        reinterpret_cast<std::uintptr_t>(args.out) |
                        reinterpret_cast<std::uintptr_t>(args.bias) | std::uintptr_t{256};
  return static_cast<std::uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

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
std::string problem(const PlanKey& key) {
  return "m=" + std::to_string(key.m) + ", n=" + std::to_string(key.n) +
         ", k=" + std::to_string(key.k) + ", " +
         (key.scale_mode == Fp8ScaleMode::kRowwise ? "rowwise" : "tensorwise") +
         " scales, out_dtype " + out_name(key.out_dtype) +
         ", use_fast_accum=" + (key.fast_accum ? "True" : "False") + ", pointers aligned to " +
         std::to_string(key.alignment) + " bytes";
}

constexpr const char* kRequirements =
    "FP8 GEMMs need an sm_89 or newer GPU (rowwise scales: cuBLASLt has them for Hopper, sm_90, "
    "not for Blackwell) and a CUDA 12.9 or newer cuBLAS. Try tensorwise scales or another "
    "out_dtype.";

// The cuBLASLt loaded at run time (it may be older than the headers built against), for the
// refusals: "cuBLASLt 12.8.4".
std::string library_version() {
  const std::size_t v = cublasLtGetVersion();
  return "cuBLASLt " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

[[noreturn]] void unsupported(const PlanKey& key, const std::string& why) {
  throw Fp8GemmUnsupported("ampfuse.fp8_gemm: " + library_version() + " cannot run " +
                           problem(key) + " on CUDA device " + std::to_string(key.device) + ": " +
                           why + ". " + kRequirements);
}

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

struct PreferenceOwner {
  cublasLtMatmulPreference_t preference = nullptr;
  ~PreferenceOwner() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
  }
};

// The matmul descriptor of `key`, with the bias epilogue when `with_bias`.
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

// Puts the heuristic's first algorithm for the plan's descriptors into the plan and returns
// CUBLAS_STATUS_SUCCESS; when it has none, the heuristic's status (CUBLAS_STATUS_NOT_SUPPORTED
// when it answered but found nothing), which the refusal quotes: an INVALID_VALUE there points
// at the descriptors, not at the GPU.
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

// Plans one host thread keeps. An FP8 Linear makes three problems per distinct token count
// (forward, input grad, weight grad: m or k is the tokens), so a transformer block of four to
// six Linear shapes needs 12 to 18 plans per token count: 256 holds a dozen or more token
// counts of such a model at once (bucketed or padded sequence lengths), where a fixed-shape
// run needs a few dozen plans and never evicts. Each plan is a few cuBLASLt descriptors of
// host memory; what a miss costs is the heuristic query again. Bounded so that a run whose
// sequence length varies freely does not grow the cache for as long as it runs. Evicting a
// plan whose GEMM may still be running is fine: cuBLASLt reads the descriptors on the host
// inside cublasLtMatmul (torch's own cuBLASLt GEMMs destroy theirs as soon as it returns).
constexpr std::size_t kPlanCacheCapacity = 256;

std::atomic<std::int64_t> plans_built{0};
std::atomic<std::int64_t> plans_reused{0};
std::atomic<std::int64_t> plans_evicted{0};

using PlanCache = LruCache<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>;

PlanCache& thread_plans() {
  thread_local PlanCache plans(kPlanCacheCapacity);
  return plans;
}

// The returned plan stays valid until this thread's next plan_for call (which may evict it)
// or until fp8_gemm erases it after a refused first launch.
Plan& plan_for(const PlanKey& key, const Fp8GemmArgs& args, cublasLtHandle_t handle) {
  PlanCache& plans = thread_plans();
  if (std::unique_ptr<Plan>* found = plans.find(key)) {
    plans_reused.fetch_add(1, std::memory_order_relaxed);
    return **found;
  }
  std::unique_ptr<Plan> plan;
  refusals_of_rowwise(key, [&] { plan = build_plan(key, args, handle); });
  plans_built.fetch_add(1, std::memory_order_relaxed);
  const std::int64_t evictions_before = plans.evictions();
  Plan& cached = *plans.insert(key, std::move(plan));
  plans_evicted.fetch_add(plans.evictions() - evictions_before, std::memory_order_relaxed);
  return cached;
}

}  // namespace

namespace {

cublasStatus_t launch(Plan& plan, const Fp8GemmArgs& args, const Fp8GemmContext& context,
                      cublasLtHandle_t handle, StreamHandle stream) {
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.b_scale_inv,
                "setting A's scale");
  set_attribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.a_scale_inv,
                "setting B's scale");
  if (plan.fused_bias) {
    set_attribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias, "setting the bias");
  }
  const float alpha = 1.0f;
  const float beta = 0.0f;  // C is D's buffer and is not read
  return cublasLtMatmul(handle, plan.op, &alpha, args.b, plan.a, args.a, plan.b, &beta, args.out,
                        plan.out, args.out, plan.out, &plan.algo, context.workspace,
                        context.workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
}

// Launches a plan, and at its first launch turns cuBLASLt's refusals into a retry without the
// bias epilogue or into Fp8GemmUnsupported. Returns whether the bias was fused.
bool launch_plan(Plan& plan, const PlanKey& key, const Fp8GemmArgs& args,
                 const Fp8GemmContext& context, cublasLtHandle_t handle, StreamHandle stream) {
  cublasStatus_t status = launch(plan, args, context, handle, stream);
  if (status != CUBLAS_STATUS_SUCCESS && !plan.launched && plan.fused_bias &&
      (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
    // cuBLASLt checks some combinations (scale modes with epilogues) only at the launch, and
    // refuses them there before enqueuing anything: run this problem without the bias
    // epilogue from now on; the caller adds the bias.
    refusals_of_rowwise(key, [&] {
      describe(plan, key, false);
      plan.fused_bias = false;
      describe_pointers(plan, key, args);
      const cublasStatus_t found = pick_algorithm(plan, key, handle);
      if (found != CUBLAS_STATUS_SUCCESS) {
        unsupported(key, no_algorithm(found, " without the bias epilogue"));
      }
      status = launch(plan, args, context, handle, stream);
    });
  }
  if (status != CUBLAS_STATUS_SUCCESS && !plan.launched &&
      (status == CUBLAS_STATUS_NOT_SUPPORTED || key.scale_mode == Fp8ScaleMode::kRowwise)) {
    // Refused before anything was enqueued, by a plan that has never run here: cuBLASLt cannot
    // do this problem (for rowwise scales any status, as in refusals_of_rowwise).
    unsupported(key, std::string("cublasLtMatmul refused the first launch with ") +
                         cublasLtGetStatusString(status));
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("ampfuse.fp8_gemm: cublasLtMatmul failed (") +
                             cublasLtGetStatusString(status) + ") for " + problem(key) + "; " +
                             kRequirements);
  }
  plan.launched = true;
  return plan.fused_bias;
}

}  // namespace

bool fp8_gemm(const Fp8GemmArgs& args, const Fp8GemmContext& context, StreamHandle stream) {
  const auto handle = static_cast<cublasLtHandle_t>(context.blaslt_handle);
  const PlanKey key{args.device,
                    args.m,
                    args.n,
                    args.k,
                    args.a_format,
                    args.b_format,
                    args.scale_mode,
                    args.fast_accum,
                    args.bias != nullptr,
                    args.out_dtype,
                    common_alignment(args),
                    context.workspace_bytes};
  Plan& plan = plan_for(key, args, handle);
  try {
    return launch_plan(plan, key, args, context, handle, stream);
  } catch (...) {
    // A plan that never ran and was refused (or whose retry without the bias epilogue failed
    // half-way, leaving it a descriptor the algorithm was not chosen for) is not kept: the next
    // call of this problem builds and asks cuBLASLt afresh instead of launching it again.
    if (!plan.launched) thread_plans().erase(key);
    throw;
  }
}

Fp8GemmPlanStats fp8_gemm_plan_stats() {
  return {plans_built.load(std::memory_order_relaxed), plans_reused.load(std::memory_order_relaxed),
          plans_evicted.load(std::memory_order_relaxed),
          static_cast<std::int64_t>(kPlanCacheCapacity)};
}

}  // namespace ampfuse::kernels::cuda
