// fused_sgd_: momentum, dampening, nesterov, weight decay (before or after the
// momentum) and maximize in one pass, with the same master/scale/skip contract
// and the same 16-byte packs as fused_adam_. The step count tells the prologue
// whether momentum buffers are being seeded (first step).
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 momentum buffers, 3 masters.
constexpr int kSgdDepth = 4;

struct SgdFunctor {
  __device__ void operator()(const ChunkTable<kSgdDepth>& table, StepScalars scalars,
                             const SgdStep* constants, bool has_momentum, bool has_master,
                             bool write_grads, MasterMode mode, std::uint64_t seed) const {
    if (step_is_skipped(scalars)) return;
    const SgdStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    if (mode != MasterMode::kFp32) {
      // The masters list (3) holds the mode's extra array.
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto m) {
        constexpr bool kWrite = decltype(write)::value;
        constexpr MasterMode kMode = decltype(m)::value;
        if (has_momentum) {
          const ChunkState<1> state{{fp32_list(table, chunk, 2)}, nullptr};
          update_bf16_chunk<kMode, 1, kWrite>(
              table, chunk, grad, 3, state, seed, step.steps_taken, step.grad_scale,
              [&](float& p, float g, float* s) { sgd_update<true>(p, g, s[0], step); });
        } else {
          const ChunkState<0> state{{nullptr}, nullptr};
          update_bf16_chunk<kMode, 0, kWrite>(table, chunk, grad, 3, state, seed, step.steps_taken,
                                              step.grad_scale, [&](float& p, float g, float*) {
                                                float unused = 0.0f;
                                                sgd_update<false>(p, g, unused, step);
                                              });
        }
      });
      return;
    }
    float* master = has_master ? fp32_list(table, chunk, 3) : nullptr;
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      constexpr bool kWrite = decltype(write)::value;
      if (has_momentum) {
        const ChunkState<1> state{{fp32_list(table, chunk, 2)}, master};
        update_chunk<1, kWrite>(
            param, grad, state, chunk.size, step.grad_scale,
            [&](float& p, float g, float* s) { sgd_update<true>(p, g, s[0], step); });
      } else {
        const ChunkState<0> state{{nullptr}, master};
        update_chunk<0, kWrite>(param, grad, state, chunk.size, step.grad_scale,
                                [&](float& p, float g, float*) {
                                  float unused = 0.0f;
                                  sgd_update<false>(p, g, unused, step);
                                });
      }
    });
  }
};

}  // namespace

void sgd(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
         const std::vector<TensorRef>& momentum_buffers, const std::vector<TensorRef>& masters,
         const SgdConfig& config, const StepScalars& scalars, bool write_grads, SgdStep* constants,
         StreamHandle stream, const MasterListMode& master_mode) {
  launch_step_prologue(config, scalars, constants, stream);
  const std::vector<TensorRef>* lists[kSgdDepth] = {
      &params, &grads, or_params(momentum_buffers, params), or_params(masters, params)};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  launch_multi_tensor_with_ids<kSgdDepth>(
      "fused_sgd_", lists, stochastic ? &master_mode.param_ids : nullptr, stream, SgdFunctor{},
      scalars, static_cast<const SgdStep*>(constants), !momentum_buffers.empty(),
      master_mode.mode == MasterMode::kFp32 && !masters.empty(), write_grads, master_mode.mode,
      master_mode.seed);
}

}  // namespace ampfuse::kernels::cuda
