// fused_sgd_: momentum, dampening, nesterov, weight decay and maximize in one
// pass, with the same master/scale/skip contract as fused_adam_. The step count
// tells the kernel whether momentum buffers are being seeded (first step).
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 momentum buffers, 3 masters.
constexpr int kSgdDepth = 4;

struct SgdFunctor {
  __device__ void operator()(const ChunkTable<kSgdDepth>& table, SgdConfig config,
                             StepScalars scalars, bool has_momentum, bool has_master) const {
    if (step_is_skipped(scalars)) return;
    const float lr = *scalars.lr;
    const float factor = grad_factor(scalars);
    const bool first_step = *scalars.step == 0.0f;
    const BlockChunk chunk = block_chunk(table);
    float* momentum = has_momentum
                          ? static_cast<float*>(table.addresses[2][chunk.slot]) + chunk.start
                          : nullptr;
    float* master =
        has_master ? static_cast<float*>(table.addresses[3][chunk.slot]) + chunk.start : nullptr;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* param_tag) {
      using Param = std::remove_pointer_t<decltype(param_tag)>;
      with_element_type(table.dtypes[1][chunk.slot], [&](auto* grad_tag) {
        using Grad = std::remove_pointer_t<decltype(grad_tag)>;
        Param* param = static_cast<Param*>(table.addresses[0][chunk.slot]) + chunk.start;
        const Grad* grad = static_cast<const Grad*>(table.addresses[1][chunk.slot]) + chunk.start;
        // SGD moves few bytes per element; the loop is simple enough for the compiler
        // to keep loads coalesced without explicit packs.
        const auto update_all = [&](auto has_momentum) {
          for (int i = threadIdx.x; i < chunk.size; i += blockDim.x) {
            float p = master ? master[i] : DeviceElement<Param>::load(param[i]);
            float unused = 0.0f;
            sgd_update<decltype(has_momentum)::value>(p, DeviceElement<Grad>::load(grad[i]),
                                                      momentum ? momentum[i] : unused, config, lr,
                                                      factor, first_step);
            if (master) master[i] = p;
            param[i] = DeviceElement<Param>::store(p);
          }
        };
        if (momentum) {
          update_all(std::true_type{});
        } else {
          update_all(std::false_type{});
        }
      });
    });
  }
};

__global__ void advance_step_kernel(StepScalars scalars) {
  if (!step_is_skipped(scalars)) *scalars.step += 1.0f;
}

}  // namespace

void advance_step(const StepScalars& scalars, StreamHandle stream) {
  advance_step_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(scalars);
  throw_on_launch_error("optimizer step counter");
}

void sgd(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
         const std::vector<TensorRef>& momentum_buffers, const std::vector<TensorRef>& masters,
         const SgdConfig& config, const StepScalars& scalars, StreamHandle stream) {
  const std::vector<TensorRef>* lists[kSgdDepth] = {
      &params, &grads, or_params(momentum_buffers, params), or_params(masters, params)};
  launch_multi_tensor<kSgdDepth>("fused_sgd_", lists, stream, SgdFunctor{}, config, scalars,
                                 !momentum_buffers.empty(), !masters.empty());
  advance_step(scalars, stream);
}

}  // namespace ampfuse::kernels::cuda
