// fused_adam_: one pass per element reads the gradient (any float dtype, scaled
// by 1/grad_scale), updates the fp32 moments and the fp32 master (or the param
// itself), and writes the param in its own dtype. An overflow skips everything.
#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 max_exp_avg_sqs, 5 masters.
constexpr int kAdamDepth = 6;
constexpr int kPack = 4;

template <bool kAmsgrad, typename Param, typename Grad>
__device__ void adam_chunk(Param* param, const Grad* grad, float* m, float* v, float* max_v,
                           float* master, int n, const AdamStep& step) {
  const bool has_master = master != nullptr;
  const auto element = [&](int i) {
    float p = has_master ? master[i] : DeviceElement<Param>::load(param[i]);
    float unused = 0.0f;
    adam_update<kAmsgrad>(p, DeviceElement<Grad>::load(grad[i]), m[i], v[i],
                          kAmsgrad ? max_v[i] : unused, step);
    if (has_master) master[i] = p;
    param[i] = DeviceElement<Param>::store(p);
  };
  const auto pack = [&](int i) {
    using F4 = Pack<float, kPack>;
    const Pack<Grad, kPack> g = *reinterpret_cast<const Pack<Grad, kPack>*>(grad + i);
    Pack<Param, kPack> pp = *reinterpret_cast<const Pack<Param, kPack>*>(param + i);
    F4 mm = *reinterpret_cast<const F4*>(m + i);
    F4 vv = *reinterpret_cast<const F4*>(v + i);
    F4 xx = kAmsgrad ? *reinterpret_cast<const F4*>(max_v + i) : F4{};
    F4 ww = has_master ? *reinterpret_cast<const F4*>(master + i) : F4{};
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      float p = has_master ? ww.v[k] : DeviceElement<Param>::load(pp.v[k]);
      adam_update<kAmsgrad>(p, DeviceElement<Grad>::load(g.v[k]), mm.v[k], vv.v[k], xx.v[k], step);
      ww.v[k] = p;
      pp.v[k] = DeviceElement<Param>::store(p);
    }
    *reinterpret_cast<Pack<Param, kPack>*>(param + i) = pp;
    *reinterpret_cast<F4*>(m + i) = mm;
    *reinterpret_cast<F4*>(v + i) = vv;
    if (kAmsgrad) *reinterpret_cast<F4*>(max_v + i) = xx;
    if (has_master) *reinterpret_cast<F4*>(master + i) = ww;
  };
  const bool aligned = is_aligned_16(param) && is_aligned_16(grad) && is_aligned_16(m) &&
                       is_aligned_16(v) && (!max_v || is_aligned_16(max_v)) &&
                       (!has_master || is_aligned_16(master));
  visit_chunk<kPack>(n, aligned, pack, element);
}

struct AdamFunctor {
  __device__ void operator()(const ChunkTable<kAdamDepth>& table, AdamConfig config,
                             StepScalars scalars, bool has_master) const {
    if (step_is_skipped(scalars)) return;
    const AdamStep step = make_adam_step(config, *scalars.step, *scalars.lr, grad_factor(scalars));
    const BlockChunk chunk = block_chunk(table);
    const auto list = [&](int d) {
      return static_cast<float*>(table.addresses[d][chunk.slot]) + chunk.start;
    };
    float* max_v = config.amsgrad ? list(4) : nullptr;
    float* master = has_master ? list(5) : nullptr;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* param_tag) {
      using Param = std::remove_pointer_t<decltype(param_tag)>;
      with_element_type(table.dtypes[1][chunk.slot], [&](auto* grad_tag) {
        using Grad = std::remove_pointer_t<decltype(grad_tag)>;
        Param* param = static_cast<Param*>(table.addresses[0][chunk.slot]) + chunk.start;
        const Grad* grad = static_cast<const Grad*>(table.addresses[1][chunk.slot]) + chunk.start;
        if (config.amsgrad) {
          adam_chunk<true>(param, grad, list(2), list(3), max_v, master, chunk.size, step);
        } else {
          adam_chunk<false>(param, grad, list(2), list(3), max_v, master, chunk.size, step);
        }
      });
    });
  }
};

}  // namespace

void adam(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& max_exp_avg_sqs, const std::vector<TensorRef>& masters,
          const AdamConfig& config, const StepScalars& scalars, StreamHandle stream) {
  const std::vector<TensorRef>* lists[kAdamDepth] = {
      &params, &grads, &exp_avgs, &exp_avg_sqs, or_params(max_exp_avg_sqs, params),
      or_params(masters, params)};
  launch_multi_tensor<kAdamDepth>("fused_adam_", lists, stream, AdamFunctor{}, config, scalars,
                                  !masters.empty());
  advance_step(scalars, stream);
}

}  // namespace ampfuse::kernels::cuda
