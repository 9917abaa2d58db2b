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
__device__ __forceinline__ void update_element(const ChunkState<K>& state, int i, float& p, float g,
                                               Update& update) {
  float s[K > 0 ? K : 1];
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = state.arrays[k][i];
  update(p, g, s);
#pragma unroll
  for (int k = 0; k < K; ++k) state.arrays[k][i] = s[k];
}

// The kPack grads at i with the loss scale divided out, into g; stored back so with kWriteGrad.
// Called before the state packs are loaded, so the grad pack is dead while the update runs:
// that keeps Adam with AMSGrad and write-back within 64 registers (2 blocks of 512 threads per
// SM) without spilling.
template <bool kWriteGrad, int kPack, typename Grad>
__device__ __forceinline__ void unscaled_grad_pack(Grad* grad, int i, float grad_scale,
                                                   float (&g)[kPack]) {
  Pack<Grad, kPack> gg = *reinterpret_cast<const Pack<Grad, kPack>*>(grad + i);
#pragma unroll
  for (int j = 0; j < kPack; ++j) {
    g[j] = unscale_grad(DeviceElement<Grad>::load(gg.v[j]), grad_scale);
    if (kWriteGrad) gg.v[j] = DeviceElement<Grad>::store(g[j]);
  }
  if (kWriteGrad) *reinterpret_cast<Pack<Grad, kPack>*>(grad + i) = gg;
}

// update(p, g[j], s) for each element j of the pack at i: the K state packs loaded before and
// stored after, p from param(j) and handed back through store_param(j, p).
template <int K, int kPack, typename Update, typename Param, typename StoreParam>
__device__ __forceinline__ void update_pack(const ChunkState<K>& state, int i,
                                            const float (&g)[kPack], Update& update, Param&& param,
                                            StoreParam&& store_param) {
  using F4 = Pack<float, kPack>;
  F4 ss[K > 0 ? K : 1];
#pragma unroll
  for (int k = 0; k < K; ++k) ss[k] = *reinterpret_cast<const F4*>(state.arrays[k] + i);
#pragma unroll
  for (int j = 0; j < kPack; ++j) {
    float p = param(j);
    float s[K > 0 ? K : 1];
#pragma unroll
    for (int k = 0; k < K; ++k) s[k] = ss[k].v[j];
    update(p, g[j], s);
#pragma unroll
    for (int k = 0; k < K; ++k) ss[k].v[j] = s[k];
    store_param(j, p);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) *reinterpret_cast<F4*>(state.arrays[k] + i) = ss[k];
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
  const auto pack = [&](int i) {
    float g[kPack];
    unscaled_grad_pack<kWriteGrad>(grad, i, grad_scale, g);
    // With a master the param is only written: its old value is not read.
    Pack<Param, kPack> pp =
        has_master ? Pack<Param, kPack>{} : *reinterpret_cast<const Pack<Param, kPack>*>(param + i);
    F4 ww = has_master ? *reinterpret_cast<const F4*>(state.master + i) : F4{};
    update_pack(
        state, i, g, update,
        [&](int j) { return has_master ? ww.v[j] : DeviceElement<Param>::load(pp.v[j]); },
        [&](int j, float p) {
          ww.v[j] = p;
          pp.v[j] = DeviceElement<Param>::store(p);
        });
    *reinterpret_cast<Pack<Param, kPack>*>(param + i) = pp;
    if (has_master) *reinterpret_cast<F4*>(state.master + i) = ww;
  };
  bool aligned =
      is_aligned_16(param) && is_aligned_16(grad) && (!has_master || is_aligned_16(state.master));
#pragma unroll
  for (int k = 0; k < K; ++k) aligned = aligned && is_aligned_16(state.arrays[k]);
  visit_chunk<kPack>(n, aligned, pack, element);
}

// A chunk of a bf16 param in one of the bf16 modes (bf16_modes.h): the param, and `extra` (list
// `extra_list` of the table) holding the kahan compensations or split low halves, untouched in
// kStochastic, whose random bits are keyed by the param id the launcher put in the table's
// list_index and by the element's index in the tensor.
template <MasterMode kMode>
struct Bf16Chunk {
  static constexpr bool kStochastic = kMode == MasterMode::kStochastic;
  std::uint16_t* param;
  std::uint16_t* extra;
  RoundingKey key;
  std::uint32_t first_lo;  // the chunk's first element in the tensor

  template <int Depth>
  __device__ Bf16Chunk(const ChunkTable<Depth>& table, const BlockChunk& chunk, int extra_list,
                       std::uint64_t seed, float steps_taken)
      : param(static_cast<std::uint16_t*>(table.addresses[0][chunk.slot]) + chunk.start),
        extra(static_cast<std::uint16_t*>(table.addresses[extra_list][chunk.slot]) + chunk.start),
        key(chunk_key(rounding_key(seed, steps_taken,
                                   static_cast<std::uint32_t>(table.list_index[chunk.slot])),
                      chunk.start)),
        first_lo(static_cast<std::uint32_t>(chunk.start)) {}

  // Whether the param and (outside kStochastic) the extra array read as packs of N elements.
  template <int N>
  __device__ bool packs_aligned() const {
    return is_aligned_for_pack<std::uint16_t, N>(param) &&
           (kStochastic || is_aligned_for_pack<std::uint16_t, N>(extra));
  }
  // The value element i holds; its bits for `param`, `extra`, given the new value.
  __device__ float value(std::uint16_t param_bits, std::uint16_t extra_bits) const {
    return Bf16Param<kMode>::load(param_bits, kStochastic ? std::uint16_t{0} : extra_bits);
  }
  __device__ void bits(float x, int i, std::uint16_t& param_bits, std::uint16_t& extra_bits) const {
    Bf16Param<kMode>::store(x, param_bits, extra_bits,
                            kStochastic ? rounding_bits(key, first_lo + i) : 0u);
  }
  // Element i read, changed by f(p), and written back.
  template <typename F>
  __device__ void update(int i, F&& f) const {
    float p = value(param[i], kStochastic ? std::uint16_t{0} : extra[i]);
    f(p);
    std::uint16_t new_param, new_extra;
    bits(p, i, new_param, new_extra);
    param[i] = new_param;
    if constexpr (!kStochastic) extra[i] = new_extra;
  }
};

// update(p, g, s) on every element of such a chunk, as update_chunk does for the others: g the
// unscaled grad (stored back so with kWriteGrad), s[0..K) the state values. Where the param, the
// extra array, the grads and the state are all aligned to their packs, 4 elements move per
// access (8 bytes of each 16-bit array, 16 of each fp32 one), as update_chunk's packs do: one
// 2-byte access per element kept too few bytes in flight per thread, and the H100 ran "split",
// which moves fewer bytes than fp32 masters, at 1.27x their time. Each element's arithmetic and
// random bits are the same in both paths, so the results are too. With three state arrays
// (AMSGrad) the packs would spill at Adam's 64 registers, so that case keeps the element loop.
template <MasterMode kMode, int K, bool kWriteGrad, int Depth, typename Grad, typename Update>
__device__ void update_bf16_chunk(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                  Grad* grad, int extra_list, const ChunkState<K>& state,
                                  std::uint64_t seed, float steps_taken, float grad_scale,
                                  Update&& update) {
  constexpr int kPack = 4;
  constexpr bool stochastic = Bf16Chunk<kMode>::kStochastic;
  using Bits = Pack<std::uint16_t, kPack>;
  const Bf16Chunk<kMode> bf16(table, chunk, extra_list, seed, steps_taken);

  const auto element = [&](int i) {
    const float g = unscaled_grad<kWriteGrad>(grad, i, grad_scale);
    bf16.update(i, [&](float& p) { update_element(state, i, p, g, update); });
  };
  const auto pack = [&](int i) {
    float g[kPack];
    unscaled_grad_pack<kWriteGrad>(grad, i, grad_scale, g);
    Bits pp = *reinterpret_cast<const Bits*>(bf16.param + i);
    Bits ee = stochastic ? Bits{} : *reinterpret_cast<const Bits*>(bf16.extra + i);
    update_pack(
        state, i, g, update, [&](int j) { return bf16.value(pp.v[j], ee.v[j]); },
        [&](int j, float p) { bf16.bits(p, i + j, pp.v[j], ee.v[j]); });
    *reinterpret_cast<Bits*>(bf16.param + i) = pp;
    if constexpr (!stochastic) *reinterpret_cast<Bits*>(bf16.extra + i) = ee;
  };
  if constexpr (K > 2) {
    for (int i = threadIdx.x; i < chunk.size; i += blockDim.x) element(i);
  } else {
    bool aligned = bf16.template packs_aligned<kPack>() && is_aligned_for_pack<Grad, kPack>(grad);
#pragma unroll
    for (int k = 0; k < K; ++k) aligned = aligned && is_aligned_16(state.arrays[k]);
    visit_chunk<kPack>(chunk.size, aligned, pack, element);
  }
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
