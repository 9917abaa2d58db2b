// fused_adagrad_: Adagrad (adagrad_math.h) in one pass, with the same master/scale/skip contract
// and the same 16-byte packs as fused_adam_ and fused_sgd_: a one-thread prologue forms the
// step's constants (clr from the device-side count and lr) and advances the count, then one
// multi-tensor launch updates the sums, the masters and the params.
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 state sums, 3 masters (params if none).
constexpr int kAdagradDepth = 4;

struct AdagradFunctor {
  // The default 2 blocks per SM: 62 registers on sm_90, no spills and no stack frame. At 3 (40
  // registers) sm_80 needs a 40-byte stack frame.
  __device__ void operator()(const ChunkTable<kAdagradDepth>& table, StepScalars scalars,
                             const AdagradStep* constants, bool has_master,
                             bool write_grads) const {
    if (step_is_skipped(scalars)) return;
    const AdagradStep step = *constants;
    const BlockChunk chunk = block_chunk(table);
    float* master = has_master ? fp32_list(table, chunk, 3) : nullptr;
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      constexpr bool kWrite = decltype(write)::value;
      const ChunkState<1> state{{fp32_list(table, chunk, 2)}, master};
      update_chunk<1, kWrite>(param, grad, state, chunk.size, step.grad_scale,
                              [&](float& p, float g, float* s) {
                                adagrad_update(p, g, s[0], step);
                              });
    });
  }
};

}  // namespace

void adagrad(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
             const std::vector<TensorRef>& state_sums, const std::vector<TensorRef>& masters,
             const AdagradConfig& config, const StepScalars& scalars, bool write_grads,
             AdagradStep* constants, StreamHandle stream) {
  // The step count advances even for an empty list, as in adam and sgd.
  launch_step_prologue(config, scalars, constants, stream);
  const std::vector<TensorRef>* lists[kAdagradDepth] = {&params, &grads, &state_sums,
                                                        or_params(masters, params)};
  launch_multi_tensor<kAdagradDepth>("fused_adagrad_", lists, stream, AdagradFunctor{}, scalars,
                                     static_cast<const AdagradStep*>(constants), !masters.empty(),
                                     write_grads);
}

}  // namespace ampfuse::kernels::cuda
