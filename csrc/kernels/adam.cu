// fused_adam_: one pass per element reads the gradient (any float dtype, divided
// by grad_scale and optionally written back so), updates the fp32 moments and the
// fp32 master (or the param itself, or a bf16 param through its master mode), and
// writes the param in its own dtype. An overflow skips everything.
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 max_exp_avg_sqs, 5 masters.
constexpr int kAdamDepth = 6;

struct AdamFunctor {
  __device__ void operator()(const ChunkTable<kAdamDepth>& table, StepScalars scalars,
                             const AdamStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, std::uint64_t seed) const {
    if (step_is_skipped(scalars)) return;
    const AdamStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    float* m = fp32_list(table, chunk, 2);
    float* v = fp32_list(table, chunk, 3);
    if (mode != MasterMode::kFp32) {
      // The masters list (5) holds the mode's extra array; max_exp_avg_sqs is list 4 either way.
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto m_) {
        constexpr bool kWrite = decltype(write)::value;
        constexpr MasterMode kMode = decltype(m_)::value;
        if (step.amsgrad) {
          const ChunkState<3> state{{m, v, fp32_list(table, chunk, 4)}, nullptr};
          update_bf16_chunk<kMode, 3, kWrite>(table, chunk, grad, 5, state, seed, step.steps_taken,
                                              step.grad_scale, [&](float& p, float g, float* s) {
                                                adam_update<true>(p, g, s[0], s[1], s[2], step);
                                              });
        } else {
          const ChunkState<2> moments{{m, v}, nullptr};
          update_bf16_chunk<kMode, 2, kWrite>(table, chunk, grad, 5, moments, seed,
                                              step.steps_taken, step.grad_scale,
                                              [&](float& p, float g, float* s) {
                                                float unused = 0.0f;
                                                adam_update<false>(p, g, s[0], s[1], unused, step);
                                              });
        }
      });
      return;
    }
    float* master = has_master ? fp32_list(table, chunk, 5) : nullptr;
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      constexpr bool kWrite = decltype(write)::value;
      if (step.amsgrad) {
        const ChunkState<3> state{{m, v, fp32_list(table, chunk, 4)}, master};
        update_chunk<3, kWrite>(
            param, grad, state, chunk.size, step.grad_scale,
            [&](float& p, float g, float* s) { adam_update<true>(p, g, s[0], s[1], s[2], step); });
      } else {
        const ChunkState<2> state{{m, v}, master};
        update_chunk<2, kWrite>(param, grad, state, chunk.size, step.grad_scale,
                                [&](float& p, float g, float* s) {
                                  float unused = 0.0f;
                                  adam_update<false>(p, g, s[0], s[1], unused, step);
                                });
      }
    });
  }
};

}  // namespace

void adam(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& max_exp_avg_sqs, const std::vector<TensorRef>& masters,
          const AdamConfig& config, const StepScalars& scalars, bool write_grads,
          AdamStep* constants, StreamHandle stream, const MasterListMode& master_mode) {
  launch_step_prologue(config, scalars, constants, stream);
  const std::vector<TensorRef>* lists[kAdamDepth] = {&params,
                                                     &grads,
                                                     &exp_avgs,
                                                     &exp_avg_sqs,
                                                     or_params(max_exp_avg_sqs, params),
                                                     or_params(masters, params)};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  launch_multi_tensor_with_ids<kAdamDepth>(
      "fused_adam_", lists, stochastic ? &master_mode.param_ids : nullptr, stream, AdamFunctor{},
      scalars, static_cast<const AdamStep*>(constants),
      master_mode.mode == MasterMode::kFp32 && !masters.empty(), write_grads, master_mode.mode,
      master_mode.seed);
}

}  // namespace ampfuse::kernels::cuda
