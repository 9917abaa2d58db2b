// fused_adam_coded_: fused_adam_ with Adam's moments held as 8-bit block codes
// (state_codes.h). Each 256 threads of a CTA own one block of kStateBlock (256) elements at a
// time, one element per thread: they decode its moments, run the element update of fused_adam_
// (optimizer_math.h, the master modes of bf16_modes.h), take the absmax of the new coded values
// (code_block_absmax, coded_chunk.cuh) and code them again. An overflow skips everything; the
// prologue advances the step count once.
#include "coded_chunk.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2-4 the codes of exp_avg, exp_avg_sq, max_exp_avg_sq,
// 5 masters (or a bf16 mode's extra array), 6-8 the scales of the three moments.
constexpr int kCodedDepth = 9;

// Every block of the chunk: decode, update each element, encode. The loop bound is the same
// for every thread of the CTA (the barrier needs them all); a thread past its block's end
// holds nothing and adds 0 to the max.
template <StateCode kCode, bool kAmsgrad, bool kWriteGrad, typename Grad, typename ParamAccess>
__device__ void coded_chunk(const ChunkTable<kCodedDepth>& table, const BlockChunk& chunk,
                            Grad* grad, const ParamAccess& param, const AdamStep& step,
                            WarpMaxima<3>& warp_maxima) {
  constexpr int kMoments = kAmsgrad ? 3 : 2;
  const int t = static_cast<int>(threadIdx.x);
  const ChunkMoment<kCode, false> m{code_list(table, chunk, 2), scale_list(table, chunk, 6)};
  const ChunkMoment<kCode, true> v{code_list(table, chunk, 3), scale_list(table, chunk, 7)};
  const ChunkMoment<kCode, true> max_v{code_list(table, chunk, 4), scale_list(table, chunk, 8)};
  int buffer = 0;
  for (int round = 0; round < chunk.size; round += kThreadsPerBlock) {
    const int i = round + t;  // element i of block i / kStateBlock of the chunk
    const bool owned = i < chunk.size;
    float moments[3] = {0.0f, 0.0f, 0.0f};
    if (owned) {
      moments[0] = m.decode(i);
      moments[1] = v.decode(i);
      if (kAmsgrad) moments[2] = max_v.decode(i);
      const float g = unscaled_grad<kWriteGrad>(grad, i, step.grad_scale);
      float p = param.load(i);
      adam_update<kAmsgrad>(p, g, moments[0], moments[1], moments[2], step);
      param.store(i, p);
    }
    std::uint32_t bits[kMoments];
#pragma unroll
    for (int k = 0; k < kMoments; ++k) {
      bits[k] = owned ? magnitude_bits(k == 0 ? coded_value<false>(moments[k])
                                              : coded_value<true>(moments[k]))
                      : 0u;
    }
    float absmax[kMoments];
    code_block_absmax(bits, warp_maxima, buffer, absmax);
    if (owned) {
      m.encode(i, moments[0], absmax[0]);
      v.encode(i, moments[1], absmax[1]);
      if (kAmsgrad) max_v.encode(i, moments[2], absmax[kMoments - 1]);
      if (i % kStateBlock == 0) {
        const int block = i / kStateBlock;
        m.scales[block] = absmax[0];
        v.scales[block] = absmax[1];
        if (kAmsgrad) max_v.scales[block] = absmax[kMoments - 1];
      }
    }
    buffer ^= 1;
  }
}

struct AdamCodedFunctor {
  __device__ void operator()(const ChunkTable<kCodedDepth>& table, StepScalars scalars,
                             const AdamStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, std::uint64_t seed, StateCode code) const {
    if (step_is_skipped(scalars)) return;
    const AdamStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    __shared__ WarpMaxima<3> warp_maxima;
    const auto run = [&](auto* grad, auto write, const auto& param) {
      constexpr bool kWrite = decltype(write)::value;
      const auto with_amsgrad = [&](auto code_tag) {
        constexpr StateCode kCode = decltype(code_tag)::value;
        if (step.amsgrad) {
          coded_chunk<kCode, true, kWrite>(table, chunk, grad, param, step, warp_maxima);
        } else {
          coded_chunk<kCode, false, kWrite>(table, chunk, grad, param, step, warp_maxima);
        }
      };
      if (code == StateCode::kFp8) {
        with_amsgrad(std::integral_constant<StateCode, StateCode::kFp8>{});
      } else {
        with_amsgrad(std::integral_constant<StateCode, StateCode::kInt8>{});
      }
    };
    if (mode != MasterMode::kFp32) {
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto m_) {
        constexpr MasterMode kMode = decltype(m_)::value;
        const ModeParam<kMode> param{Bf16Chunk<kMode>(table, chunk, 5, seed, step.steps_taken)};
        run(grad, write, param);
      });
      return;
    }
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      using Param = std::remove_pointer_t<decltype(param)>;
      float* master = has_master ? fp32_list(table, chunk, 5) : nullptr;
      run(grad, write, PlainParam<Param>{param, master});
    });
  }
};

}  // namespace

void adam_coded(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
                const CodedMomentLists& moments, const std::vector<TensorRef>& masters,
                const AdamConfig& config, const StepScalars& scalars, bool write_grads,
                AdamStep* constants, StreamHandle stream, const MasterListMode& master_mode) {
  launch_step_prologue(config, scalars, constants, stream);
  const std::vector<TensorRef>* lists[kCodedDepth] = {
      &params,
      &grads,
      &moments.exp_avg_codes,
      &moments.exp_avg_sq_codes,
      or_params(moments.max_exp_avg_sq_codes, params),
      or_params(masters, params),
      &moments.exp_avg_scales,
      &moments.exp_avg_sq_scales,
      or_params(moments.max_exp_avg_sq_scales, params)};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  launch_multi_tensor_with_ids<kCodedDepth>(
      "fused_adam_coded_", lists, stochastic ? &master_mode.param_ids : nullptr, stream,
      AdamCodedFunctor{}, scalars, static_cast<const AdamStep*>(constants),
      master_mode.mode == MasterMode::kFp32 && !masters.empty(), write_grads, master_mode.mode,
      master_mode.seed, moments.code);
}

}  // namespace ampfuse::kernels::cuda
