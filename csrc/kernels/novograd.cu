// fused_novograd_: NovoGrad (novograd_math.h) in two passes over the lists, with four launches
// per step and no host sync. A one-thread prologue derives the step's constants and advances
// the step count; the first pass reads the grads only and writes each 64K-element chunk's
// reduction of its unscaled grads (sum of squares, or max |g|); a finishing launch, one block
// per tensor over the one-element running norms, adds (or maxes) each tensor's chunk partials
// in a fixed order (deterministic, no atomics, as multi_tensor_l2norm) and blends the result
// into the tensor's running norm; the second pass divides by the new norm to update the first
// moment, the master and the param (and writes the unscaled grads back with write_grads). An
// overflow skips everything but the prologue's constants.
//
// `part` splits a step in two halves, for sharded params (FSDP2), with an all-reduce of each
// tensor's reduction (a double in tensor_reductions: a sum, or a max) over the shards between:
//  - kNorms: the prologue (the count is not advanced), the first pass, and the finishing launch
//    leaving each tensor's reduction in tensor_reductions without blending it;
//  - kApply: the prologue (advancing the count), the finishing launch blending from
//    tensor_reductions as given, and the second pass.
// The constants are those of kBoth in either half (the count moves only in the second), and
// kBoth blends from the very double it leaves in tensor_reductions, so on one device the two
// halves with tensor_reductions passed unchanged are kBoth bit for bit.
//
// bf16 params without fp32 masters (master_mode "stochastic", "kahan", "split"; bf16_modes.h):
// the first pass reads only the grads, so only the second pass changes: it reads the value the
// mode holds and writes the param (and its compensation or low half) through the mode.
#include <stdexcept>

#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// First pass lists: 0 grads (the params are not read).
constexpr int kNovoGradNormsDepth = 1;
// Finishing lists: 0 norm_avgs (one element each, so one block per tensor).
constexpr int kNovoGradFinishDepth = 1;
// Second pass lists: 0 params, 1 grads, 2 exp_avgs, 3 masters (params if none): fp32 masters,
// or in a bf16 mode the compensations or low halves (nothing in kStochastic), 4 norm_avgs. The
// running norms come through the table, not by list_index, which holds the param id that keys
// stochastic rounding in kStochastic (launch_multi_tensor_with_ids).
constexpr int kNovoGradApplyDepth = 5;

// As lamb_prologue_kernel: the count advances only with `advance` (not in kNorms: kApply
// advances it).
__global__ void novograd_prologue_kernel(NovoGradConfig config, StepScalars scalars,
                                         NovoGradStep* constants, bool advance) {
  const float grad_scale = scalars.grad_scale != nullptr ? *scalars.grad_scale : 1.0f;
  *constants = make_novograd_constants(config, *scalars.step, *scalars.lr, grad_scale);
  if (advance && !step_is_skipped(scalars)) *scalars.step += 1.0f;
}

// The larger of two non-negative values, or a NaN when either is one: the max norm must not
// hide a NaN grad, which fmax would drop (max_abs_step's rule, on values that are already |g|).
template <typename T>
__device__ __forceinline__ T nan_sticky_max(T running, T x) {
  return (x > running || x != x) ? x : running;
}

// The block's NaN-sticky maximum of non-negative values, as block_sum (block_reduce).
template <typename T>
__device__ T block_max(T value) {
  return block_reduce(value, [](T a, T b) { return nan_sticky_max(a, b); });
}

// One unscaled grad into a thread's running reduction: its square added, or its |g| maxed.
template <bool kMax>
__device__ __forceinline__ float accumulate(float running, float g) {
  if constexpr (kMax) {
    return max_abs_step(running, g);
  } else {
    return running + mul(g, g);
  }
}

// This thread's share of a chunk's reduction. A thread takes at most 64K / 512 = 128 elements,
// so its fp32 sum of squares stays near one ulp, as in l2norm. Read-only, so the loads are
// batched (several in flight per thread) as l2norm's are.
template <bool kMax, typename Grad>
__device__ float thread_reduction(const Grad* grad, int n, float grad_scale) {
  constexpr int kPack = 16 / sizeof(Grad);
  using GradPack = Pack<Grad, kPack>;
  float running = 0.0f;
  const auto add = [&](Grad raw) {
    running = accumulate<kMax>(running, unscale_grad(DeviceElement<Grad>::load(raw), grad_scale));
  };
  const auto load = [&](int i) { return *reinterpret_cast<const GradPack*>(grad + i); };
  const auto use = [&](int, const GradPack& in) {
#pragma unroll
    for (int k = 0; k < kPack; ++k) add(in.v[k]);
  };
  visit_chunk_batched<kPack, GradPack>(n, is_aligned_16(grad), load, use,
                                       [&](int i) { add(grad[i]); });
  return running;
}

// The first pass. Each block leaves its chunk's reduction of its unscaled grads in
// chunk_partials[c], c its chunk's number across the whole call, and the chunk's tensor (its
// index in the full list) in chunk_owner[c]. The grads are only read.
struct NovoGradNormsFunctor {
  // The default 2 blocks per SM: 49 registers on sm_90, no spills; at 3 (40 registers) ptxas
  // spills 8 bytes on sm_90. The batched loads keep 64 bytes in flight per thread even so.
  __device__ void operator()(const ChunkTable<kNovoGradNormsDepth>& table, StepScalars scalars,
                             const NovoGradStep* constants, float* chunk_partials,
                             std::int32_t* chunk_owner) const {
    if (step_is_skipped(scalars)) return;
    const float grad_scale = constants->grad_scale;
    const bool max_norm = constants->max_norm;
    const BlockChunk chunk = block_chunk(table);
    float partial = 0.0f;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* type_tag) {
      using Grad = std::remove_pointer_t<decltype(type_tag)>;
      const Grad* grad = static_cast<const Grad*>(table.addresses[0][chunk.slot]) + chunk.start;
      partial = max_norm ? thread_reduction<true>(grad, chunk.size, grad_scale)
                         : thread_reduction<false>(grad, chunk.size, grad_scale);
    });
    // max_norm is the same for the whole block: every thread takes the same reduction.
    partial = max_norm ? block_max(partial) : block_sum(partial);
    if (threadIdx.x == 0) {
      const std::int64_t index = table.first_chunk + blockIdx.x;
      chunk_partials[index] = partial;
      chunk_owner[index] = table.list_index[chunk.slot];
    }
  }
};

// Tensor `tensor`'s reduction from its chunk partials, in double, in an order fixed by the
// chunk count alone; valid in thread 0. A tensor without elements owns no chunk: 0.
__device__ double tensor_reduction(const float* chunk_partials, const std::int32_t* chunk_owner,
                                   std::int64_t chunks, std::int32_t tensor, bool max_norm) {
  const std::int64_t begin = first_chunk_of(chunk_owner, chunks, tensor);
  const std::int64_t end = first_chunk_of(chunk_owner, chunks, tensor + 1);
  double running = 0.0;
  if (max_norm) {
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      running = nan_sticky_max(running, static_cast<double>(chunk_partials[i]));
    }
    return block_max(running);
  }
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    running += chunk_partials[i];
  }
  return block_sum(running);
}

// The finishing launch, over norm_avgs: each tensor there has one element, hence one block,
// the tensors whose params are empty included. With `reduce` (kBoth, kNorms) the block forms
// its tensor's reduction from the chunk partials and leaves it in tensor_reductions[t];
// otherwise (kApply) it takes it from there. With `blend` (kBoth, kApply) it then blends the
// reduction into the tensor's running norm, which the second pass reads.
struct NovoGradFinishFunctor {
  __device__ void operator()(const ChunkTable<kNovoGradFinishDepth>& table, StepScalars scalars,
                             const NovoGradStep* constants, const float* chunk_partials,
                             const std::int32_t* chunk_owner, std::int64_t chunks,
                             double* tensor_reductions, bool reduce, bool blend) const {
    // On overflow the first pass wrote no partials (nor owners) to search.
    if (step_is_skipped(scalars)) return;
    const int slot = block_chunk(table).slot;
    const std::int32_t tensor = table.list_index[slot];
    double reduction = 0.0;
    if (reduce) {
      reduction =
          tensor_reduction(chunk_partials, chunk_owner, chunks, tensor, constants->max_norm);
      if (threadIdx.x == 0) tensor_reductions[tensor] = reduction;
    } else if (threadIdx.x == 0) {
      reduction = tensor_reductions[tensor];
    }
    if (!blend || threadIdx.x != 0) return;
    float* norm_avg = static_cast<float*>(table.addresses[0][slot]);
    *norm_avg = novograd_blend(*norm_avg, reduction, *constants);
  }
};

// The second pass: the first moment and the param from the unscaled grad and the tensor's new
// running norm; writes the master (when there is one), the param rounded to its dtype (or in a
// bf16 mode the param and its compensation or low half through the mode) and, with
// write_grads, the unscaled grad. The running norms were written by the finishing launch
// before this one started, and nothing writes them here.
//
// kBf16Modes: a launch in a bf16 mode (`mode` one of them) or in kFp32. They are two kernels
// so that the fp32 path keeps its 3 blocks per SM (40 registers, no spills on sm_80 and sm_90,
// as before the modes): one kernel with both paths needs 62 registers, and at 40 spills about
// 300-400 bytes. The modes alone take 48 registers at the default 2 blocks per SM (no spills,
// no stack frame; at 3 they need an 8-byte stack frame), as Adagrad's and Adam's kernels run.
template <bool kBf16Modes>
struct NovoGradApplyFunctor {
  static constexpr int kMinBlocksPerSm = kBf16Modes ? 2 : 3;
  __device__ void operator()(const ChunkTable<kNovoGradApplyDepth>& table, StepScalars scalars,
                             const NovoGradStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, std::uint64_t seed) const {
    if (step_is_skipped(scalars)) return;
    const NovoGradStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    // One element per tensor: not offset by the chunk's start.
    const float norm_avg = static_cast<const float*>(table.addresses[4][chunk.slot])[0];
    const float denom = novograd_denominator(norm_avg, step);
    const auto update = [&](float& p, float g, float* s) {
      novograd_update(p, g, s[0], denom, step);
    };
    float* exp_avg = fp32_list(table, chunk, 2);
    if constexpr (kBf16Modes) {
      // The same step count as fused_adam_'s keys: the bits a param draws do not depend on
      // which optimizer steps it.
      const ChunkState<1> moments{{exp_avg}, nullptr};
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto m) {
        update_bf16_chunk<decltype(m)::value, 1, decltype(write)::value>(
            table, chunk, grad, 3, moments, seed, step.steps_taken, step.grad_scale, update);
      });
    } else {
      float* master = has_master ? fp32_list(table, chunk, 3) : nullptr;
      const ChunkState<1> state{{exp_avg}, master};
      with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
        update_chunk<1, decltype(write)::value>(param, grad, state, chunk.size, step.grad_scale,
                                                update);
      });
    }
  }
};

}  // namespace

std::int64_t novograd_scratch_chunks(const std::vector<TensorRef>& params) {
  return total_chunks(params);
}

void novograd(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
              const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& norm_avgs,
              const std::vector<TensorRef>& masters, const NovoGradConfig& config,
              const StepScalars& scalars, bool write_grads, NovoGradStep* constants,
              float* chunk_partials, std::int32_t* chunk_owner, double* tensor_reductions,
              StreamHandle stream, NovoGradPart part, const MasterListMode& master_mode) {
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  const bool reduce = part != NovoGradPart::kApply;
  const bool apply = part != NovoGradPart::kNorms;
  if (!params.empty() && tensor_reductions == nullptr) {
    throw std::invalid_argument(
        "ampfuse: fused_novograd_ needs tensor_reductions (a double per tensor)");
  }
  // The step count advances even for an empty list, as in adam, sgd and lamb (in kApply and
  // kBoth: kNorms leaves it to kApply).
  novograd_prologue_kernel<<<1, 1, 0, cuda_stream>>>(config, scalars, constants, apply);
  throw_on_launch_error("fused_novograd_ (prologue)");
  if (params.empty()) return;
  const std::int64_t chunks = total_chunks(params);
  const NovoGradStep* step = constants;

  // In the first pass and the finishing launch list_index is each tensor's index in the lists
  // (no ids are given), which is what chunk_owner and tensor_reductions are indexed by; in the
  // second pass it is the param id in kStochastic (and unread otherwise).
  if (reduce && chunks > 0) {
    const std::vector<TensorRef>* norm_lists[kNovoGradNormsDepth] = {&grads};
    launch_multi_tensor<kNovoGradNormsDepth>("fused_novograd_ (grad norms)", norm_lists, stream,
                                             NovoGradNormsFunctor{}, scalars, step, chunk_partials,
                                             chunk_owner);
  }
  // Always, even without chunks: every tensor of a shard may be empty while the other shards'
  // are not, and an empty tensor's reduction (0) is still written for the all-reduce and
  // still blended into its running norm, as the CPU op does.
  const std::vector<TensorRef>* finish_lists[kNovoGradFinishDepth] = {&norm_avgs};
  launch_multi_tensor<kNovoGradFinishDepth>(
      "fused_novograd_ (running norms)", finish_lists, stream, NovoGradFinishFunctor{}, scalars,
      step, static_cast<const float*>(chunk_partials),
      static_cast<const std::int32_t*>(chunk_owner), chunks, tensor_reductions, reduce, apply);
  if (!apply || chunks == 0) return;

  const bool has_master = master_mode.mode == MasterMode::kFp32 && !masters.empty();
  const std::vector<TensorRef>* apply_lists[kNovoGradApplyDepth] = {
      &params, &grads, &exp_avgs, or_params(masters, params), &norm_avgs};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  const auto launch = [&](auto functor) {
    launch_multi_tensor_with_ids<kNovoGradApplyDepth>(
        "fused_novograd_ (apply)", apply_lists, stochastic ? &master_mode.param_ids : nullptr,
        stream, functor, scalars, step, has_master, write_grads, master_mode.mode,
        master_mode.seed);
  };
  if (master_mode.mode == MasterMode::kFp32) {
    launch(NovoGradApplyFunctor<false>{});
  } else {
    launch(NovoGradApplyFunctor<true>{});
  }
}

}  // namespace ampfuse::kernels::cuda
