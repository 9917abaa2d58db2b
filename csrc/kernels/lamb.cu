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

#include "optimizer_step.cuh"

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
__global__ void lamb_prologue_kernel(LambConfig config, StepScalars scalars,
                                     const float* grad_norm, LambStep* constants, bool advance) {
  const float grad_scale = scalars.grad_scale != nullptr ? *scalars.grad_scale : 1.0f;
  const float norm = config.max_grad_norm > 0.0 && grad_norm != nullptr ? *grad_norm : 0.0f;
  *constants = make_lamb_constants(config, *scalars.step, *scalars.lr, grad_scale, norm);
  if (advance && !step_is_skipped(scalars)) *scalars.step += 1.0f;
}

// The first pass over one chunk: element i's fp32 param value is load(i), and load_pack(i) that
// of elements i..i+3 (i a multiple of 4). The walk, and so each thread's order of adding its
// squares, is the same however the param is held: "split", whose value is the master, gets
// the fp32 master's chunk sums bit for bit.
template <bool kWrite, typename Grad, typename Load, typename LoadPack>
__device__ __forceinline__ void lamb_moments_chunk(Grad* grad, float* m, float* v, int n,
                                                   bool aligned, const LambStep& step, Load load,
                                                   LoadPack load_pack, float& param_sq,
                                                   float& update_sq) {
  constexpr int kPack = 4;
  using F4 = Pack<float, kPack>;
  // A thread adds at most 64K / 512 = 128 squares of each in fp32, each in one FMA, as
  // l2norm does (and for its reason).
  const auto element = [&](int i) {
    const float g = unscaled_grad<kWrite>(grad, i, step.grad_scale);
    const float p = load(i);
    float mi = m[i];
    float vi = v[i];
    const float u = lamb_moments(g, p, mi, vi, step);
    m[i] = mi;
    v[i] = vi;
    param_sq = __fmaf_rn(p, p, param_sq);
    update_sq = __fmaf_rn(u, u, update_sq);
  };
  // As update_chunk: the grad pack is unscaled (and stored back) before the rest is loaded.
  const auto pack = [&](int i) {
    Pack<Grad, kPack> gg = *reinterpret_cast<const Pack<Grad, kPack>*>(grad + i);
    float g[kPack];
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      g[j] = unscale_grad(DeviceElement<Grad>::load(gg.v[j]), step.grad_scale);
      if (kWrite) gg.v[j] = DeviceElement<Grad>::store(g[j]);
    }
    if (kWrite) *reinterpret_cast<Pack<Grad, kPack>*>(grad + i) = gg;
    const F4 pp = load_pack(i);
    F4 mm = *reinterpret_cast<const F4*>(m + i);
    F4 vv = *reinterpret_cast<const F4*>(v + i);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float u = lamb_moments(g[j], pp.v[j], mm.v[j], vv.v[j], step);
      param_sq = __fmaf_rn(pp.v[j], pp.v[j], param_sq);
      update_sq = __fmaf_rn(u, u, update_sq);
    }
    *reinterpret_cast<F4*>(m + i) = mm;
    *reinterpret_cast<F4*>(v + i) = vv;
  };
  visit_chunk<kPack>(n, aligned && is_aligned_16(grad) && is_aligned_16(m) && is_aligned_16(v),
                     pack, element);
}

// The first pass. Each block leaves its chunk's two sums of squares in
// chunk_sums[2 * c] (param) and chunk_sums[2 * c + 1] (update), c its chunk's number across the
// whole call, and the chunk's tensor (its index in the full list) in chunk_owner[c]. The param
// is only read.
struct LambMomentsFunctor {
  // The default 2 blocks per SM: 64 registers on sm_90 (62 on sm_80), no spills; the fp32
  // path alone takes 56, the bf16 modes' branch 62. At 3 (40 registers) ptxas gives it a stack
  // frame.
  __device__ void operator()(const ChunkTable<kLambMomentsDepth>& table, StepScalars scalars,
                             const LambStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, float* chunk_sums,
                             std::int32_t* chunk_owner) const {
    if (step_is_skipped(scalars)) return;
    const LambStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    float* m = fp32_list(table, chunk, 2);
    float* v = fp32_list(table, chunk, 3);
    float param_sq = 0.0f;
    float update_sq = 0.0f;
    if (mode != MasterMode::kFp32) {
      // The value the mode holds; the stores are the second pass's.
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto kind) {
        constexpr MasterMode kMode = decltype(kind)::value;
        constexpr bool kStochastic = kMode == MasterMode::kStochastic;
        using Bits4 = Pack<std::uint16_t, 4>;
        const auto* param =
            static_cast<const std::uint16_t*>(table.addresses[0][chunk.slot]) + chunk.start;
        const auto* extra =
            static_cast<const std::uint16_t*>(table.addresses[4][chunk.slot]) + chunk.start;
        const auto load = [&](int i) {
          return Bf16Param<kMode>::load(param[i], kStochastic ? std::uint16_t{0} : extra[i]);
        };
        const auto load_pack = [&](int i) {
          const Bits4 pp = *reinterpret_cast<const Bits4*>(param + i);
          const Bits4 ee = kStochastic ? Bits4{} : *reinterpret_cast<const Bits4*>(extra + i);
          Pack<float, 4> out;
#pragma unroll
          for (int j = 0; j < 4; ++j) out.v[j] = Bf16Param<kMode>::load(pp.v[j], ee.v[j]);
          return out;
        };
        // The alignment test of the fp32 path with the extra array in the master's place, so
        // that both walk a chunk alike.
        const bool aligned = is_aligned_16(param) && (kStochastic || is_aligned_16(extra));
        lamb_moments_chunk<decltype(write)::value>(grad, m, v, chunk.size, aligned, step, load,
                                                   load_pack, param_sq, update_sq);
      });
    } else {
      const float* master = has_master ? fp32_list(table, chunk, 4) : nullptr;
      with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
        using Param = std::remove_pointer_t<decltype(param)>;
        const auto load = [&](int i) {
          return master != nullptr ? master[i] : DeviceElement<Param>::load(param[i]);
        };
        const auto load_pack = [&](int i) {
          if (master != nullptr) return *reinterpret_cast<const Pack<float, 4>*>(master + i);
          const Pack<Param, 4> raw = *reinterpret_cast<const Pack<Param, 4>*>(param + i);
          Pack<float, 4> out;
#pragma unroll
          for (int j = 0; j < 4; ++j) out.v[j] = DeviceElement<Param>::load(raw.v[j]);
          return out;
        };
        const bool aligned = is_aligned_16(param) && (master == nullptr || is_aligned_16(master));
        lamb_moments_chunk<decltype(write)::value>(grad, m, v, chunk.size, aligned, step, load,
                                                   load_pack, param_sq, update_sq);
      });
    }
    param_sq = block_sum(param_sq);
    update_sq = block_sum(update_sq);
    if (threadIdx.x == 0) {
      const std::int64_t index = table.first_chunk + blockIdx.x;
      chunk_sums[2 * index] = param_sq;
      chunk_sums[2 * index + 1] = update_sq;
      chunk_owner[index] = table.list_index[chunk.slot];
    }
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
  const bool aligned =
      bf16.template packs_aligned<kPack>() && is_aligned_16(m) && is_aligned_16(v);
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

void lamb(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& masters, const LambConfig& config,
          const StepScalars& scalars, const float* grad_norm, bool write_grads,
          LambStep* constants, float* chunk_sums, std::int32_t* chunk_owner, float* ratios,
          StreamHandle stream, LambPart part, double* tensor_sums,
          const MasterListMode& master_mode) {
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  const bool moments = part != LambPart::kApply;
  const bool apply = part != LambPart::kMoments;
  if (!params.empty() && part != LambPart::kBoth && tensor_sums == nullptr) {
    throw std::invalid_argument(
        "ampfuse: fused_lamb_ (part moments or apply) needs tensor_sums (2 doubles per tensor)");
  }
  // The step count advances even for an empty list, as in adam and sgd (in kApply and kBoth:
  // kMoments leaves it to kApply).
  lamb_prologue_kernel<<<1, 1, 0, cuda_stream>>>(config, scalars, grad_norm, constants, apply);
  throw_on_launch_error("fused_lamb_ (prologue)");
  if (params.empty()) return;
  const std::int64_t chunks = total_chunks(params);
  // Every tensor of a shard may be empty while the other shards' are not: the sums (zeros)
  // are still written for the all-reduce, and kApply still forms the ratios.
  if (chunks == 0 && tensor_sums == nullptr) return;
  const bool has_master = master_mode.mode == MasterMode::kFp32 && !masters.empty();
  const LambStep* step = constants;
  const auto tensors = static_cast<std::int64_t>(params.size());

  // In the first pass list_index is each tensor's index in `params` (no ids are given), which
  // is what chunk_owner, the finishing kernel's blocks, `ratios` and `tensor_sums` are indexed
  // by. The second pass reads its ratios through the table; there list_index is the param id
  // in kStochastic.
  if (moments) {
    if (chunks > 0) {
      const std::vector<TensorRef>* moment_lists[kLambMomentsDepth] = {
          &params, &grads, &exp_avgs, &exp_avg_sqs, or_params(masters, params)};
      launch_multi_tensor<kLambMomentsDepth>("fused_lamb_ (moments)", moment_lists, stream,
                                             LambMomentsFunctor{}, scalars, step, has_master,
                                             write_grads, master_mode.mode, chunk_sums,
                                             chunk_owner);
    }
    // Without chunks (kMoments, or kBoth asked for tensor_sums) every block finds none: zeros.
    finish_lamb_kernel<<<static_cast<unsigned>(tensors), kThreadsPerBlock, 0, cuda_stream>>>(
        chunk_sums, chunk_owner, chunks, scalars, step, apply ? ratios : nullptr, tensor_sums);
    throw_on_launch_error("fused_lamb_ (trust ratios)");
  } else {
    constexpr int kRatioThreads = 256;
    const std::int64_t blocks =
        std::min<std::int64_t>((tensors + kRatioThreads - 1) / kRatioThreads, 1024);
    ratios_from_sums_kernel<<<static_cast<unsigned>(blocks), kRatioThreads, 0, cuda_stream>>>(
        tensor_sums, tensors, scalars, step, ratios);
    throw_on_launch_error("fused_lamb_ (trust ratios from sums)");
  }
  if (!apply || chunks == 0) return;

  // Each tensor's ratio as a one-element list entry (see kLambApplyDepth).
  std::vector<TensorRef> ratio_refs;
  ratio_refs.reserve(params.size());
  for (std::int64_t t = 0; t < tensors; ++t) ratio_refs.push_back({ratios + t, 1, DType::kFloat32});
  const std::vector<TensorRef>* apply_lists[kLambApplyDepth] = {
      &params, &exp_avgs, &exp_avg_sqs, or_params(masters, params), &ratio_refs};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  launch_multi_tensor_with_ids<kLambApplyDepth>(
      "fused_lamb_ (apply)", apply_lists, stochastic ? &master_mode.param_ids : nullptr, stream,
      LambApplyFunctor{}, scalars, step, has_master, master_mode.mode, master_mode.seed);
}

}  // namespace ampfuse::kernels::cuda
