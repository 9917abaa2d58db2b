// fused_lamb_coded_: LAMB (lamb_math.h) over moments held as 8-bit block codes (state_codes.h),
// decoded and coded inside the two passes, with the launches of fused_lamb_ around them
// (run_lamb_passes, lamb.cu) and no fp32 copy of the moments.
//
// LAMB's second pass needs the new moments at full precision, which the first pass cannot
// store in codes it will read back. So, as on the CPU (csrc/ops/lamb_coded.cpp):
//  - the first pass decodes the moments, forms the new ones and each chunk's sums of squares
//    of param and update, and writes nothing but the sums (lamb_moments_block, with a read-only
//    moments policy);
//  - the second pass forms the new moments again from the same codes, grads and params (the
//    same arithmetic, so the same bits), moves the param by ratio times the update that gave,
//    codes the moments, and writes the unscaled grads. Each 256 threads of a CTA own one code
//    block at a time, one element each, as fused_adam_coded_'s kernel does (coded_chunk.cuh).
// Both equal decoding the moments, running fused_lamb_ on them and coding them again, bit for
// bit: the first pass walks a chunk as fused_lamb_'s does over freshly allocated fp32 moments,
// so its sums are added in the same order. An overflow skips everything but the prologue's
// constants.
#include "coded_chunk.cuh"
#include "lamb_passes.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// First pass lists: 0 params, 1 grads, 2-3 the codes of exp_avg and exp_avg_sq, 4 masters
// (kLambMasterList: fp32 masters, a bf16 mode's extra arrays, or params if neither), 5-6 the
// scales of the two moments.
constexpr int kCodedMomentsDepth = 7;
// Second pass lists: those, and 7 each tensor's trust ratio (one float), which comes through
// the table as in fused_lamb_'s second pass, leaving list_index to the param id.
constexpr int kCodedApplyDepth = 8;
static_assert(kLambMasterList == 4, "the masters where lamb_moments_block reads them");

// The first pass's moments (lamb_passes.cuh's policies): decoded, never stored. The codes are
// read a byte at a time, so packs need no alignment of theirs: the walk is the one
// fused_lamb_ takes over fp32 moments that chunks start 16-byte aligned in, as the moments
// decoded into fresh tensors are.
template <StateCode kCode>
struct DecodedLambMoments {
  ChunkMoment<kCode, false> exp_avg;
  ChunkMoment<kCode, true> exp_avg_sq;
  __device__ bool packs_aligned() const { return true; }
  __device__ void load(int i, float& m, float& v) const {
    m = exp_avg.decode(i);
    v = exp_avg_sq.decode(i);
  }
  __device__ void store(int, float, float) const {}
  // i is a multiple of 4, so the pack lies in one code block: one scale of each moment.
  __device__ void load_pack(int i, LambF4& m, LambF4& v) const {
    const float m_scale = exp_avg.scales[i / kStateBlock];
    const float v_scale = exp_avg_sq.scales[i / kStateBlock];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      m.v[j] = decode_moment<kCode, false>(exp_avg.codes[i + j], m_scale);
      v.v[j] = decode_moment<kCode, true>(exp_avg_sq.codes[i + j], v_scale);
    }
  }
  __device__ void store_pack(int, const LambF4&, const LambF4&) const {}
};

struct LambCodedMomentsFunctor {
  __device__ void operator()(const ChunkTable<kCodedMomentsDepth>& table, StepScalars scalars,
                             const LambStep* constants, bool has_master, MasterMode mode,
                             StateCode code, float* chunk_sums, std::int32_t* chunk_owner) const {
    if (step_is_skipped(scalars)) return;
    const LambStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    const auto run = [&](auto code_tag) {
      constexpr StateCode kCode = decltype(code_tag)::value;
      const DecodedLambMoments<kCode> moments{
          {code_list(table, chunk, 2), scale_list(table, chunk, 5)},
          {code_list(table, chunk, 3), scale_list(table, chunk, 6)}};
      // The grads are read only: the second pass reads them again and writes them.
      lamb_moments_block(table, chunk, moments, has_master, /*write_grads=*/false, mode, step,
                         chunk_sums, chunk_owner);
    };
    if (code == StateCode::kFp8) {
      run(std::integral_constant<StateCode, StateCode::kFp8>{});
    } else {
      run(std::integral_constant<StateCode, StateCode::kInt8>{});
    }
  }
};

// The second pass over one chunk (see the file comment). The loop bound is the same for every
// thread of the CTA (code_block_absmax's barrier needs them all); a thread past the chunk's end
// holds nothing and adds 0 to the maxima.
template <StateCode kCode, bool kWriteGrad, typename Grad, typename ParamAccess>
__device__ void apply_coded_chunk(const ChunkTable<kCodedApplyDepth>& table,
                                  const BlockChunk& chunk, Grad* grad, const ParamAccess& param,
                                  float ratio, const LambStep& step, WarpMaxima<2>& maxima) {
  const int t = static_cast<int>(threadIdx.x);
  const ChunkMoment<kCode, false> exp_avg{code_list(table, chunk, 2), scale_list(table, chunk, 5)};
  const ChunkMoment<kCode, true> exp_avg_sq{code_list(table, chunk, 3),
                                            scale_list(table, chunk, 6)};
  int buffer = 0;
  for (int round = 0; round < chunk.size; round += kThreadsPerBlock) {
    const int i = round + t;  // element i of block i / kStateBlock of the chunk
    const bool owned = i < chunk.size;
    float m = 0.0f;
    float v = 0.0f;
    if (owned) {
      m = exp_avg.decode(i);
      v = exp_avg_sq.decode(i);
      const float g = unscaled_grad<kWriteGrad>(grad, i, step.grad_scale);
      float p = param.load(i);
      const float update = lamb_moments(g, p, m, v, step);
      lamb_apply_update(p, update, ratio);
      param.store(i, p);
    }
    const std::uint32_t bits[2] = {owned ? magnitude_bits(coded_value<false>(m)) : 0u,
                                   owned ? magnitude_bits(coded_value<true>(v)) : 0u};
    float absmax[2];
    code_block_absmax(bits, maxima, buffer, absmax);
    if (owned) {
      exp_avg.encode(i, m, absmax[0]);
      exp_avg_sq.encode(i, v, absmax[1]);
      if (i % kStateBlock == 0) {
        exp_avg.scales[i / kStateBlock] = absmax[0];
        exp_avg_sq.scales[i / kStateBlock] = absmax[1];
      }
    }
    buffer ^= 1;
  }
}

struct LambCodedApplyFunctor {
  __device__ void operator()(const ChunkTable<kCodedApplyDepth>& table, StepScalars scalars,
                             const LambStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, std::uint64_t seed, StateCode code) const {
    if (step_is_skipped(scalars)) return;
    const LambStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    const float ratio = *static_cast<const float*>(table.addresses[7][chunk.slot]);
    __shared__ WarpMaxima<2> maxima;
    const auto run = [&](auto* grad, auto write, const auto& param) {
      constexpr bool kWrite = decltype(write)::value;
      if (code == StateCode::kFp8) {
        apply_coded_chunk<StateCode::kFp8, kWrite>(table, chunk, grad, param, ratio, step, maxima);
      } else {
        apply_coded_chunk<StateCode::kInt8, kWrite>(table, chunk, grad, param, ratio, step, maxima);
      }
    };
    if (mode != MasterMode::kFp32) {
      // The same step count as the first pass and as fused_adam_'s keys: the bits a param
      // draws do not depend on which optimizer steps it.
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto kind) {
        constexpr MasterMode kMode = decltype(kind)::value;
        const ModeParam<kMode> param{
            Bf16Chunk<kMode>(table, chunk, kLambMasterList, seed, step.steps_taken)};
        run(grad, write, param);
      });
      return;
    }
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      using Param = std::remove_pointer_t<decltype(param)>;
      float* master = has_master ? fp32_list(table, chunk, kLambMasterList) : nullptr;
      run(grad, write, PlainParam<Param>{param, master});
    });
  }
};

}  // namespace

void lamb_coded(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
                const CodedMomentLists& moments, const std::vector<TensorRef>& masters,
                const LambConfig& config, const StepScalars& scalars, const float* grad_norm,
                bool write_grads, LambStep* constants, float* chunk_sums, std::int32_t* chunk_owner,
                float* ratios, StreamHandle stream, LambPart part, double* tensor_sums,
                const MasterListMode& master_mode) {
  const bool has_master = master_mode.mode == MasterMode::kFp32 && !masters.empty();
  const LambStep* step = constants;
  const std::vector<TensorRef>* masters_or_params = or_params(masters, params);
  const auto first_pass = [&] {
    const std::vector<TensorRef>* lists[kCodedMomentsDepth] = {&params,
                                                               &grads,
                                                               &moments.exp_avg_codes,
                                                               &moments.exp_avg_sq_codes,
                                                               masters_or_params,
                                                               &moments.exp_avg_scales,
                                                               &moments.exp_avg_sq_scales};
    launch_multi_tensor<kCodedMomentsDepth>(
        "fused_lamb_coded_ (moments)", lists, stream, LambCodedMomentsFunctor{}, scalars, step,
        has_master, master_mode.mode, moments.code, chunk_sums, chunk_owner);
  };
  const auto second_pass = [&](const std::vector<TensorRef>& ratio_refs) {
    const std::vector<TensorRef>* lists[kCodedApplyDepth] = {&params,
                                                             &grads,
                                                             &moments.exp_avg_codes,
                                                             &moments.exp_avg_sq_codes,
                                                             masters_or_params,
                                                             &moments.exp_avg_scales,
                                                             &moments.exp_avg_sq_scales,
                                                             &ratio_refs};
    const bool stochastic = master_mode.mode == MasterMode::kStochastic;
    launch_multi_tensor_with_ids<kCodedApplyDepth>(
        "fused_lamb_coded_ (apply)", lists, stochastic ? &master_mode.param_ids : nullptr, stream,
        LambCodedApplyFunctor{}, scalars, step, has_master, write_grads, master_mode.mode,
        master_mode.seed, moments.code);
  };
  run_lamb_passes("fused_lamb_coded_", params, config, scalars, grad_norm, constants, chunk_sums,
                  chunk_owner, ratios, stream, part, tensor_sums,
                  /*first_pass_only_sums=*/true, first_pass, second_pass);
}

}  // namespace ampfuse::kernels::cuda
