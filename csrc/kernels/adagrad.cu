// fused_adagrad_: Adagrad (adagrad_math.h) in one pass, with the same master/scale/skip contract
// (bf16 master modes included) and the same 16-byte packs as fused_adam_ and fused_sgd_: a
// one-thread prologue forms the step's constants (clr from the device-side count and lr) and
// advances the count, then one multi-tensor launch updates the sums, the masters and the params.
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 state sums, 3 masters or a bf16 mode's extra arrays
// (params if none).
constexpr int kAdagradDepth = 4;

struct AdagradFunctor {
  // The default 2 blocks per SM: 62 registers on sm_80 and sm_90 with the bf16 modes as
  // without them, no spills and no stack frame. At 3 (40 registers) both spill (56-byte stack
  // frames; sm_80 needed 40 bytes before the bf16 modes).
  __device__ void operator()(const ChunkTable<kAdagradDepth>& table, StepScalars scalars,
                             const AdagradStep* constants, bool has_master, bool write_grads,
                             MasterMode mode, std::uint64_t seed) const {
    if (step_is_skipped(scalars)) return;
    const AdagradStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    const auto update = [&](float& p, float g, float* s) { adagrad_update(p, g, s[0], step); };
    const ChunkState<1> sums{{fp32_list(table, chunk, 2)}, nullptr};
    if (mode != MasterMode::kFp32) {
      // The masters list (3) holds the mode's extra array.
      with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto m) {
        update_bf16_chunk<decltype(m)::value, 1, decltype(write)::value>(
            table, chunk, grad, 3, sums, seed, step.steps_taken, step.grad_scale, update);
      });
      return;
    }
    float* master = has_master ? fp32_list(table, chunk, 3) : nullptr;
    const ChunkState<1> state{{sums.arrays[0]}, master};
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      update_chunk<1, decltype(write)::value>(param, grad, state, chunk.size, step.grad_scale,
                                              update);
    });
  }
};

}  // namespace

void adagrad(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
             const std::vector<TensorRef>& state_sums, const std::vector<TensorRef>& masters,
             const AdagradConfig& config, const StepScalars& scalars, bool write_grads,
             AdagradStep* constants, StreamHandle stream, const MasterListMode& master_mode) {
  // The step count advances even for an empty list, as in adam and sgd.
  launch_step_prologue(config, scalars, constants, stream);
  const std::vector<TensorRef>* lists[kAdagradDepth] = {&params, &grads, &state_sums,
                                                        or_params(masters, params)};
  const bool stochastic = master_mode.mode == MasterMode::kStochastic;
  launch_multi_tensor_with_ids<kAdagradDepth>(
      "fused_adagrad_", lists, stochastic ? &master_mode.param_ids : nullptr, stream,
      AdagradFunctor{}, scalars, static_cast<const AdagradStep*>(constants),
      master_mode.mode == MasterMode::kFp32 && !masters.empty(), write_grads, master_mode.mode,
      master_mode.seed);
}

}  // namespace ampfuse::kernels::cuda
