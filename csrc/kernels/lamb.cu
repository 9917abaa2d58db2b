// fused_lamb_: LAMB (lamb_math.h) in two passes over the lists, with four launches per step
// and no host sync. A one-thread prologue derives the step's constants (they need the global
// grad norm for the clip) and advances the step count; the first pass unscales the grads
// (written back so with write_grads), updates the fp32 moments and writes each 64K-element
// chunk's sums of squares of the fp32 param and of the update; a finishing kernel adds each
// tensor's chunk sums in a fixed order (deterministic, no atomics, as multi_tensor_l2norm) into
// its trust ratio; the second pass recomputes each update from the stored moments and applies
// it. An overflow skips everything but the prologue's constants.
//
// `part` splits a step in two halves, for sharded params (FSDP2), with an all-reduce of each
// tensor's two sums (as doubles, in tensor_sums) over the shards between them:
//  - kMoments: the prologue (the count is not advanced), the first pass, and the finishing
//    kernel writing each tensor's sums to tensor_sums instead of forming its ratio;
//  - kApply: the prologue (advancing the count), a kernel forming the ratios from tensor_sums
//    as the finishing kernel does from its own sums, and the second pass.
// The constants are those of kBoth in either half (the count moves only in the second), so on
// one device the two halves with tensor_sums passed unchanged are kBoth bit for bit. kBoth also
// writes tensor_sums when it is not null.
//
// bf16 params without fp32 masters (master_mode "stochastic", "kahan", "split"; bf16_modes.h):
// both passes read the value the mode holds, so the trust ratio's ||param|| is that value's
// norm, and only the second pass writes the param (and its compensation or low half).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "lamb_passes.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// First pass lists: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 masters (params if none):
// fp32 masters, or in a bf16 mode the compensations or low halves (nothing in kStochastic).
constexpr int kLambMomentsDepth = 5;
// Second pass lists: 0 params, 1 exp_avgs, 2 exp_avg_sqs, 3 masters (as in the first pass),
// 4 each tensor's trust ratio (one float). The ratio comes through the table, as NovoGrad's
// norm_avgs do, so that list_index is free to carry the param id that keys stochastic rounding.
constexpr int kLambApplyDepth = 5;

// As step_prologue_kernel, with the grad norm that the clip divisor needs; it is read only
// when clipping is on (the launcher's caller may pass null otherwise: a 0 norm, no clip, which
// kApply may pass since the second pass does not use the clip). The count advances only with
// `advance` (not in kMoments: kApply advances it).
__global__ void lamb_prologue_kernel(LambConfig config, StepScalars scalars, const float* grad_norm,
                                     LambStep* constants, bool advance) {
  const float grad_scale = scalars.grad_scale != nullptr ? *scalars.grad_scale : 1.0f;
  const float norm = config.max_grad_norm > 0.0 && grad_norm != nullptr ? *grad_norm : 0.0f;
  *constants = make_lamb_constants(config, *scalars.step, *scalars.lr, grad_scale, norm);
  if (advance && !step_is_skipped(scalars)) *scalars.step += 1.0f;
}

// The first pass over fp32 moments (lamb_moments_block). The param is only read.
struct LambMomentsFunctor {
  // The default 2 blocks per SM: 64 registers on sm_90 (62 on sm_80), no spills; the fp32
  // path alone takes 56, the bf16 modes' branch 62. At 3 (40 registers) ptxas gives it a stack
  // frame.
  __device__ void operator()(const ChunkTable<kLambMomentsDepth>& table, StepScalars scalars,
                             const LambStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, float* chunk_sums, std::int32_t* chunk_owner) const {
    if (step_is_skipped(scalars)) return;
    const LambStep step = *constants;  // in registers, not read through the pointer
    const BlockChunk chunk = block_chunk(table);
    const FloatLambMoments moments{fp32_list(table, chunk, 2), fp32_list(table, chunk, 3)};
    lamb_moments_block(table, chunk, moments, has_master, write_grads, mode, step, chunk_sums,
                       chunk_owner);
  }
};

// A tensor's step size from its two sums of squares (the finishing kernel's, or kApply's
// tensor_sums): the same double sqrt and float lamb_ratio in both, so that the halves give
// kBoth's ratios bit for bit.
__device__ __forceinline__ float ratio_from_sums(double param_sum, double update_sum,
                                                 const LambStep& step) {
  return lamb_ratio(static_cast<float>(sqrt(param_sum)), static_cast<float>(sqrt(update_sum)),
                    step);
}

// Block t adds tensor t's chunk sums in double, in an order fixed by the chunk count alone,
// and turns the two norms into the tensor's step size in ratios[t] and/or leaves the two sums
// in tensor_sums[2t] and [2t + 1] (each output skipped when null). A tensor without elements
// owns no chunk: its sums are 0, its ratio the plain lr, and no pass reads it.
__global__ void __launch_bounds__(kThreadsPerBlock)
    finish_lamb_kernel(const float* chunk_sums, const std::int32_t* chunk_owner,
                       std::int64_t chunks, StepScalars scalars, const LambStep* constants,
                       float* ratios, double* tensor_sums) {
  // On overflow the first pass wrote no chunk sums (nor owners) to search.
  if (step_is_skipped(scalars)) return;
  const auto tensor = static_cast<std::int32_t>(blockIdx.x);
  const std::int64_t begin = first_chunk_of(chunk_owner, chunks, tensor);
  const std::int64_t end = first_chunk_of(chunk_owner, chunks, tensor + 1);
  double param_sum = 0.0;
  double update_sum = 0.0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    param_sum += chunk_sums[2 * i];
    update_sum += chunk_sums[2 * i + 1];
  }
  param_sum = block_sum(param_sum);
  update_sum = block_sum(update_sum);
  if (threadIdx.x != 0) return;
  if (tensor_sums != nullptr) {
    tensor_sums[2 * static_cast<std::int64_t>(tensor)] = param_sum;
    tensor_sums[2 * static_cast<std::int64_t>(tensor) + 1] = update_sum;
  }
  if (ratios != nullptr) ratios[tensor] = ratio_from_sums(param_sum, update_sum, *constants);
}

// kApply's ratios: ratios[t] from tensor_sums[2t] and [2t + 1] (summed over the shards by the
// caller), one thread per tensor.
__global__ void ratios_from_sums_kernel(const double* tensor_sums, std::int64_t tensors,
                                        StepScalars scalars, const LambStep* constants,
                                        float* ratios) {
  if (step_is_skipped(scalars)) return;
  const LambStep step = *constants;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       t < tensors; t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    ratios[t] = ratio_from_sums(tensor_sums[2 * t], tensor_sums[2 * t + 1], step);
  }
}

// The second pass over a chunk of a bf16 param in a bf16 mode: 4 elements per access where the
// param, the mode's extra array and the moments are aligned to their packs, as in
// update_bf16_chunk (the same per-element arithmetic and random bits either way).
template <MasterMode kMode>
__device__ void apply_bf16_chunk(const Bf16Chunk<kMode>& bf16, const float* m, const float* v,
                                 int n, float ratio, const LambStep& step) {
  constexpr int kPack = 4;
  constexpr bool stochastic = Bf16Chunk<kMode>::kStochastic;
  using Bits = Pack<std::uint16_t, kPack>;
  using F4 = Pack<float, kPack>;
  const auto element = [&](int i) {
    bf16.update(i, [&](float& p) { lamb_apply(p, m[i], v[i], ratio, step); });
  };
  const auto pack = [&](int i) {
    Bits pp = *reinterpret_cast<const Bits*>(bf16.param + i);
    Bits ee = stochastic ? Bits{} : *reinterpret_cast<const Bits*>(bf16.extra + i);
    const F4 mm = *reinterpret_cast<const F4*>(m + i);
    const F4 vv = *reinterpret_cast<const F4*>(v + i);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float p = bf16.value(pp.v[j], ee.v[j]);
      lamb_apply(p, mm.v[j], vv.v[j], ratio, step);
      bf16.bits(p, i + j, pp.v[j], ee.v[j]);
    }
    *reinterpret_cast<Bits*>(bf16.param + i) = pp;
    if constexpr (!stochastic) *reinterpret_cast<Bits*>(bf16.extra + i) = ee;
  };
  const bool aligned = bf16.template packs_aligned<kPack>() && is_aligned_16(m) && is_aligned_16(v);
  visit_chunk<kPack>(n, aligned, pack, element);
}

// The second pass: p -= ratio * update, with the update recomputed from the stored moments;
// writes the master (when there is one) and the param rounded to its dtype, or in a bf16 mode
// the param and its compensation or low half through the mode.
struct LambApplyFunctor {
  // 40 registers on sm_90 (38 on sm_80), no spills.
  static constexpr int kMinBlocksPerSm = 3;
  __device__ void operator()(const ChunkTable<kLambApplyDepth>& table, StepScalars scalars,
                             const LambStep* constants, bool has_master, MasterMode mode,
                             std::uint64_t seed) const {
    if (step_is_skipped(scalars)) return;
    const LambStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    const float ratio = *static_cast<const float*>(table.addresses[4][chunk.slot]);
    const float* m = fp32_list(table, chunk, 1);
    const float* v = fp32_list(table, chunk, 2);
    if (mode != MasterMode::kFp32) {
      // The same step count as the first pass and as fused_adam_'s keys: the bits a param
      // draws do not depend on which optimizer steps it.
      with_bf16_mode(mode, [&](auto kind) {
        constexpr MasterMode kMode = decltype(kind)::value;
        apply_bf16_chunk(Bf16Chunk<kMode>(table, chunk, 3, seed, step.steps_taken), m, v,
                         chunk.size, ratio, step);
      });
      return;
    }
    float* master = has_master ? fp32_list(table, chunk, 3) : nullptr;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* type_tag) {
      using Param = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int kPack = 4;
      using F4 = Pack<float, kPack>;
      Param* param = static_cast<Param*>(table.addresses[0][chunk.slot]) + chunk.start;
      const auto element = [&](int i) {
        float p = master != nullptr ? master[i] : DeviceElement<Param>::load(param[i]);
        lamb_apply(p, m[i], v[i], ratio, step);
        if (master != nullptr) master[i] = p;
        param[i] = DeviceElement<Param>::store(p);
      };
      const auto pack = [&](int i) {
        // With a master the param is only written: its old value is not read.
        Pack<Param, kPack> pp = master != nullptr
                                    ? Pack<Param, kPack>{}
                                    : *reinterpret_cast<const Pack<Param, kPack>*>(param + i);
        F4 ww = master != nullptr ? *reinterpret_cast<const F4*>(master + i) : F4{};
        const F4 mm = *reinterpret_cast<const F4*>(m + i);
        const F4 vv = *reinterpret_cast<const F4*>(v + i);
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
          float p = master != nullptr ? ww.v[j] : DeviceElement<Param>::load(pp.v[j]);
          lamb_apply(p, mm.v[j], vv.v[j], ratio, step);
          ww.v[j] = p;
          pp.v[j] = DeviceElement<Param>::store(p);
        }
        *reinterpret_cast<Pack<Param, kPack>*>(param + i) = pp;
        if (master != nullptr) *reinterpret_cast<F4*>(master + i) = ww;
      };
      const bool aligned = is_aligned_16(param) && is_aligned_16(m) && is_aligned_16(v) &&
                           (master == nullptr || is_aligned_16(master));
      visit_chunk<kPack>(chunk.size, aligned, pack, element);
    });
  }
};

}  // namespace

std::int64_t lamb_scratch_chunks(const std::vector<TensorRef>& params) {
  return total_chunks(params);
}

void run_lamb_passes(const char* op, const std::vector<TensorRef>& params, const LambConfig& config,
                     const StepScalars& scalars, const float* grad_norm, LambStep* constants,
                     float* chunk_sums, std::int32_t* chunk_owner, float* ratios,
                     StreamHandle stream, LambPart part, double* tensor_sums,
                     bool first_pass_only_sums, const std::function<void()>& first_pass,
                     const std::function<void(const std::vector<TensorRef>&)>& second_pass) {
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  const bool moments = part != LambPart::kApply;
  const bool apply = part != LambPart::kMoments;
  if (!params.empty() && part != LambPart::kBoth && tensor_sums == nullptr) {
    throw std::invalid_argument(std::string("ampfuse: ") + op +
                                " (part moments or apply) needs tensor_sums (2 doubles per "
                                "tensor)");
  }
  const std::string what = op;
  // The step count advances even for an empty list, as in adam and sgd (in kApply and kBoth:
  // kMoments leaves it to kApply).
  lamb_prologue_kernel<<<1, 1, 0, cuda_stream>>>(config, scalars, grad_norm, constants, apply);
  throw_on_launch_error((what + " (prologue)").c_str());
  if (params.empty()) return;
  const std::int64_t chunks = total_chunks(params);
  // Every tensor of a shard may be empty while the other shards' are not: the sums (zeros)
  // are still written for the all-reduce, and kApply still forms the ratios.
  if (chunks == 0 && tensor_sums == nullptr) return;
  const auto tensors = static_cast<std::int64_t>(params.size());

  // In the first pass list_index is each tensor's index in `params` (no ids are given), which
  // is what chunk_owner, the finishing kernel's blocks, `ratios` and `tensor_sums` are indexed
  // by. The second pass reads its ratios through the table; there list_index is the param id
  // in kStochastic.
  // Without a trust ratio (no weight decay, no use_nvlamb) every ratio is lr: a first pass
  // that writes only sums is left out of a whole step that returns none, as on the CPU.
  const bool sums_unused = first_pass_only_sums && part == LambPart::kBoth &&
                           tensor_sums == nullptr &&
                           !make_lamb_constants(config, 0.0f, 0.0f, 1.0f, 0.0f).trust;
  if (moments) {
    if (chunks > 0 && !sums_unused) first_pass();
    // Without chunks (kMoments, or kBoth asked for tensor_sums, or sums unused) every block
    // finds none: zeros, and the plain lr as each ratio.
    finish_lamb_kernel<<<static_cast<unsigned>(tensors), kThreadsPerBlock, 0, cuda_stream>>>(
        chunk_sums, chunk_owner, sums_unused ? 0 : chunks, scalars, constants,
        apply ? ratios : nullptr, tensor_sums);
    throw_on_launch_error((what + " (trust ratios)").c_str());
  } else {
    constexpr int kRatioThreads = 256;
    const std::int64_t blocks =
        std::min<std::int64_t>((tensors + kRatioThreads - 1) / kRatioThreads, 1024);
    ratios_from_sums_kernel<<<static_cast<unsigned>(blocks), kRatioThreads, 0, cuda_stream>>>(
        tensor_sums, tensors, scalars, constants, ratios);
    throw_on_launch_error((what + " (trust ratios from sums)").c_str());
  }
  if (!apply || chunks == 0) return;

  // Each tensor's ratio as a one-element list entry (see kLambApplyDepth).
  std::vector<TensorRef> ratio_refs;
  ratio_refs.reserve(params.size());
  for (std::int64_t t = 0; t < tensors; ++t) ratio_refs.push_back({ratios + t, 1, DType::kFloat32});
  second_pass(ratio_refs);
}

void lamb(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& masters, const LambConfig& config,
          const StepScalars& scalars, const float* grad_norm, bool write_grads, LambStep* constants,
          float* chunk_sums, std::int32_t* chunk_owner, float* ratios, StreamHandle stream,
          LambPart part, double* tensor_sums, const MasterListMode& master_mode) {
  const bool has_master = master_mode.mode == MasterMode::kFp32 && !masters.empty();
  const LambStep* step = constants;
  const auto first_pass = [&] {
    const std::vector<TensorRef>* lists[kLambMomentsDepth] = {
        &params, &grads, &exp_avgs, &exp_avg_sqs, or_params(masters, params)};
    launch_multi_tensor<kLambMomentsDepth>("fused_lamb_ (moments)", lists, stream,
                                           LambMomentsFunctor{}, scalars, step, has_master,
                                           write_grads, master_mode.mode, chunk_sums, chunk_owner);
  };
  const auto second_pass = [&](const std::vector<TensorRef>& ratio_refs) {
    const std::vector<TensorRef>* lists[kLambApplyDepth] = {
        &params, &exp_avgs, &exp_avg_sqs, or_params(masters, params), &ratio_refs};
    const bool stochastic = master_mode.mode == MasterMode::kStochastic;
    launch_multi_tensor_with_ids<kLambApplyDepth>(
        "fused_lamb_ (apply)", lists, stochastic ? &master_mode.param_ids : nullptr, stream,
        LambApplyFunctor{}, scalars, step, has_master, master_mode.mode, master_mode.seed);
  };
  run_lamb_passes("fused_lamb_", params, config, scalars, grad_norm, constants, chunk_sums,
                  chunk_owner, ratios, stream, part, tensor_sums, /*first_pass_only_sums=*/false,
                  first_pass, second_pass);
}

}  // namespace ampfuse::kernels::cuda
