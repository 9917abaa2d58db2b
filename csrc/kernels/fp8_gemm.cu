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
// drops its least recently used plan when full. What a plan holds and how it is built is in
// fp8_gemm_plan.h/.cu; this file keeps the plans and launches them.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>

#include "fp8_cuda.h"
#include "fp8_gemm_plan.h"
#include "lru_cache.h"

namespace ampfuse::kernels::cuda {
namespace {

using gemm_plan::build_plan;
using gemm_plan::common_alignment;
using gemm_plan::describe;
using gemm_plan::describe_pointers;
using gemm_plan::kRequirements;
using gemm_plan::no_algorithm;
using gemm_plan::pick_algorithm;
using gemm_plan::Plan;
using gemm_plan::PlanKey;
using gemm_plan::PlanKeyHash;
using gemm_plan::problem;
using gemm_plan::refusals_of_rowwise;
using gemm_plan::set_attribute;
using gemm_plan::unsupported;

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
