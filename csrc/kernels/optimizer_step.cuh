// Pieces shared by the CUDA optimizer kernels: the prologue that derives a step's
// constants once and advances the step count, skipping on overflow, and the
// element loop over one chunk (16-byte packs where aligned).
#pragma once

#include <type_traits>

#include "bf16_modes.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace ampfuse::kernels::cuda {

__device__ inline bool step_is_skipped(const StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.0f;
}

// One thread derives the step's constants (make_step_constants: for Adam two double pows, a
// divide and a sqrt) from the device-side count, lr and loss scale, instead of every thread of
// every block doing it, and then advances the count. The update kernels queued after it on the
// stream read only `constants`, never the count, so advancing it here races with nothing and
// needs no launch of its own.
template <typename Config, typename Constants>
__global__ void step_prologue_kernel(Config config, StepScalars scalars, Constants* constants) {
  const float grad_scale = scalars.grad_scale != nullptr ? *scalars.grad_scale : 1.0f;
  *constants = make_step_constants(config, *scalars.step, *scalars.lr, grad_scale);
  if (!step_is_skipped(scalars)) *scalars.step += 1.0f;
}

template <typename Config, typename Constants>
void launch_step_prologue(const Config& config, const StepScalars& scalars, Constants* constants,
                          StreamHandle stream) {
  step_prologue_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(config, scalars,
                                                                            constants);
  throw_on_launch_error("optimizer step prologue");
}

// Optional lists travel as copies of the params list so the table keeps a fixed
// depth; the kernel ignores them when the matching flag is off.
inline const std::vector<TensorRef>* or_params(const std::vector<TensorRef>& list,
                                               const std::vector<TensorRef>& params) {
  return list.empty() ? &params : &list;
}

// List `d` of the table at this block's chunk, as fp32 (state and masters are fp32).
template <int Depth>
__device__ float* fp32_list(const ChunkTable<Depth>& table, const BlockChunk& chunk, int d) {
  return static_cast<float*>(table.addresses[d][chunk.slot]) + chunk.start;
}

// Calls f(param, grad, write_grad) with list 0 (params) and list 1 (grads) typed for this
// block's tensor and write_grad as a std::bool_constant.
template <int Depth, typename F>
__device__ void with_param_and_grad(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                    bool write_grad, F&& f) {
  with_element_type(table.dtypes[0][chunk.slot], [&](auto* param_tag) {
    using Param = std::remove_pointer_t<decltype(param_tag)>;
    with_element_type(table.dtypes[1][chunk.slot], [&](auto* grad_tag) {
      using Grad = std::remove_pointer_t<decltype(grad_tag)>;
      Param* param = static_cast<Param*>(table.addresses[0][chunk.slot]) + chunk.start;
      Grad* grad = static_cast<Grad*>(table.addresses[1][chunk.slot]) + chunk.start;
      if (write_grad) {
        f(param, grad, std::true_type{});
      } else {
        f(param, grad, std::false_type{});
      }
    });
  });
}

// The fp32 arrays a chunk updates besides the param: K state arrays (moments, momentum
// buffers) and the master, null when the param is updated directly.
template <int K>
struct ChunkState {
  float* arrays[K > 0 ? K : 1];
  float* master;
};

// Element i's grad with the loss scale divided out, stored back so with kWriteGrad.
template <bool kWriteGrad, typename Grad>
__device__ __forceinline__ float unscaled_grad(Grad* grad, int i, float grad_scale) {
  const float g = unscale_grad(DeviceElement<Grad>::load(grad[i]), grad_scale);
  if (kWriteGrad) grad[i] = DeviceElement<Grad>::store(g);
  return g;
}

// update(p, g, s) with element i of the K state arrays loaded into s and stored back after.
template <int K, typename Update>
__device__ __forceinline__ void update_element(const ChunkState<K>& state, int i, float& p,
                                               float g, Update& update) {
  float s[K > 0 ? K : 1];
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = state.arrays[k][i];
  update(p, g, s);
#pragma unroll
  for (int k = 0; k < K; ++k) state.arrays[k][i] = s[k];
}

// Runs update(p, g, s) on every element of a chunk: p the fp32 param (its master when there is
// one), g the unscaled grad, s[0..K) the state values. Writes back the state, the master, the
// param rounded to its dtype and, with kWriteGrad, the unscaled grad in its own dtype. Chunks
// whose pointers are all 16-byte aligned move kPack elements per access.
template <int K, bool kWriteGrad, typename Param, typename Grad, typename Update>
__device__ void update_chunk(Param* param, Grad* grad, const ChunkState<K>& state, int n,
                             float grad_scale, Update&& update) {
  constexpr int kPack = 4;
  using F4 = Pack<float, kPack>;
  const bool has_master = state.master != nullptr;
  const auto element = [&](int i) {
    const float g = unscaled_grad<kWriteGrad>(grad, i, grad_scale);
    float p = has_master ? state.master[i] : DeviceElement<Param>::load(param[i]);
    update_element(state, i, p, g, update);
    if (has_master) state.master[i] = p;
    param[i] = DeviceElement<Param>::store(p);
  };
  // The grads are unscaled (and written back) before the state is loaded, so the grad pack is
  // dead while the update runs: that keeps Adam with AMSGrad and write-back within 64
  // registers (2 blocks of 512 threads per SM) without spilling.
  const auto pack = [&](int i) {
    Pack<Grad, kPack> gg = *reinterpret_cast<const Pack<Grad, kPack>*>(grad + i);
    float g[kPack];
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      g[j] = unscale_grad(DeviceElement<Grad>::load(gg.v[j]), grad_scale);
      if (kWriteGrad) gg.v[j] = DeviceElement<Grad>::store(g[j]);
    }
    if (kWriteGrad) *reinterpret_cast<Pack<Grad, kPack>*>(grad + i) = gg;
    // With a master the param is only written: its old value is not read.
    Pack<Param, kPack> pp = has_master ? Pack<Param, kPack>{}
                                       : *reinterpret_cast<const Pack<Param, kPack>*>(param + i);
    F4 ww = has_master ? *reinterpret_cast<const F4*>(state.master + i) : F4{};
    F4 ss[K > 0 ? K : 1];
#pragma unroll
    for (int k = 0; k < K; ++k) ss[k] = *reinterpret_cast<const F4*>(state.arrays[k] + i);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      float p = has_master ? ww.v[j] : DeviceElement<Param>::load(pp.v[j]);
      float s[K > 0 ? K : 1];
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] = ss[k].v[j];
      update(p, g[j], s);
#pragma unroll
      for (int k = 0; k < K; ++k) ss[k].v[j] = s[k];
      ww.v[j] = p;
      pp.v[j] = DeviceElement<Param>::store(p);
    }
    *reinterpret_cast<Pack<Param, kPack>*>(param + i) = pp;
#pragma unroll
    for (int k = 0; k < K; ++k) *reinterpret_cast<F4*>(state.arrays[k] + i) = ss[k];
    if (has_master) *reinterpret_cast<F4*>(state.master + i) = ww;
  };
  bool aligned = is_aligned_16(param) && is_aligned_16(grad) &&
                 (!has_master || is_aligned_16(state.master));
#pragma unroll
  for (int k = 0; k < K; ++k) aligned = aligned && is_aligned_16(state.arrays[k]);
  visit_chunk<kPack>(n, aligned, pack, element);
}

// The bf16 modes (bf16_modes.h): f(i, p) on every element i of a chunk of a bf16 param, p its
// value read through Bf16Param<kMode>, and written back through it once f has changed it. `extra` (list
// `extra_list` of the table) holds the kahan compensations or split low halves, and is not
// touched in kStochastic, whose random bits are keyed by the param id the launcher put in the
// table's list_index. One element per access: a pack of 4 bf16s is only 8 bytes, and these
// modes exist to save memory, not time.
template <MasterMode kMode, int Depth, typename F>
__device__ void visit_bf16_chunk(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                 int extra_list, std::uint64_t seed, float steps_taken, F&& f) {
  auto* param = static_cast<std::uint16_t*>(table.addresses[0][chunk.slot]) + chunk.start;
  auto* extra = static_cast<std::uint16_t*>(table.addresses[extra_list][chunk.slot]) + chunk.start;
  const RoundingKey key = chunk_key(
      rounding_key(seed, steps_taken, static_cast<std::uint32_t>(table.list_index[chunk.slot])),
      chunk.start);
  const auto first_lo = static_cast<std::uint32_t>(chunk.start);
  for (int i = threadIdx.x; i < chunk.size; i += blockDim.x) {
    constexpr bool stochastic = kMode == MasterMode::kStochastic;
    float p = Bf16Param<kMode>::load(param[i], stochastic ? std::uint16_t{0} : extra[i]);
    f(i, p);
    std::uint16_t new_param, new_extra;
    Bf16Param<kMode>::store(p, new_param, new_extra,
                            stochastic ? rounding_bits(key, first_lo + i) : 0u);
    param[i] = new_param;
    if constexpr (!stochastic) extra[i] = new_extra;
  }
}

// update(p, g, s) on every element of such a chunk, as update_chunk does for the others: g the
// unscaled grad (stored back so with kWriteGrad), s[0..K) the state values.
template <MasterMode kMode, int K, bool kWriteGrad, int Depth, typename Grad, typename Update>
__device__ void update_bf16_chunk(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                  Grad* grad, int extra_list, const ChunkState<K>& state,
                                  std::uint64_t seed, float steps_taken, float grad_scale,
                                  Update&& update) {
  visit_bf16_chunk<kMode>(table, chunk, extra_list, seed, steps_taken, [&](int i, float& p) {
    const float g = unscaled_grad<kWriteGrad>(grad, i, grad_scale);
    update_element(state, i, p, g, update);
  });
}

// Calls f(param, grad, write_grad, mode) like with_param_and_grad for a chunk of a bf16 mode
// (the op admits only bf16 params there), `mode` a std::integral_constant: the mode is a
// branch per block, each mode its own loop.
template <int Depth, typename F>
__device__ void with_bf16_chunk(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                bool write_grad, MasterMode mode, F&& f) {
  with_param_and_grad(table, chunk, write_grad, [&](auto* param, auto* grad, auto write) {
    using Param = std::remove_pointer_t<decltype(param)>;
    if constexpr (std::is_same_v<Param, __nv_bfloat16>) {
      with_bf16_mode(mode, [&](auto m) { f(grad, write, m); });
    }
  });
}

}  // namespace ampfuse::kernels::cuda
