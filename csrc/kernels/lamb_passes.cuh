// What the CUDA LAMB steps over fp32 moments (fused_lamb_, lamb.cu) and over 8-bit coded ones
// (fused_lamb_coded_, lamb_coded.cu) share: the first pass's walk over a chunk, which forms the
// new moments and the chunk's two sums of squares, and on the host the order of launches around
// the two passes (run_lamb_passes). The first pass reads its moments through a policy:
// FloatLambMoments loads and stores fp32 arrays; the coded step's policy decodes and stores
// nothing (its second pass forms the moments again from the same codes).
//
// Moments policies have:
//   bool packs_aligned() const              whether 4-element packs may be read at multiples of 4
//   void load(int i, float& m, float& v)    element i's moments
//   void store(int i, float m, float v)     element i's new moments
//   void load_pack(int i, LambF4& m, LambF4& v)  elements i..i+3 (packs_aligned() held)
//   void store_pack(int i, const LambF4& m, const LambF4& v)
#pragma once

#include <functional>
#include <vector>

#include "optimizer_step.cuh"

namespace ampfuse::kernels::cuda {

using LambF4 = Pack<float, 4>;

// Lists of the first pass's table that lamb_moments_block reads: 0 params, 1 grads, and
// kLambMasterList the fp32 masters (params if none) or a bf16 mode's compensations or low halves.
constexpr int kLambMasterList = 4;

struct FloatLambMoments {
  float* m;
  float* v;
  __device__ bool packs_aligned() const { return is_aligned_16(m) && is_aligned_16(v); }
  __device__ void load(int i, float& mi, float& vi) const {
    mi = m[i];
    vi = v[i];
  }
  __device__ void store(int i, float mi, float vi) const {
    m[i] = mi;
    v[i] = vi;
  }
  __device__ void load_pack(int i, LambF4& mm, LambF4& vv) const {
    mm = *reinterpret_cast<const LambF4*>(m + i);
    vv = *reinterpret_cast<const LambF4*>(v + i);
  }
  __device__ void store_pack(int i, const LambF4& mm, const LambF4& vv) const {
    *reinterpret_cast<LambF4*>(m + i) = mm;
    *reinterpret_cast<LambF4*>(v + i) = vv;
  }
};

// The first pass over one chunk: element i's fp32 param value is load(i), and load_pack(i) that
// of elements i..i+3 (i a multiple of 4). The walk, and so each thread's order of adding its
// squares, is the same however the param and the moments are held: "split", whose value is the
// master, gets the fp32 master's chunk sums bit for bit, and coded moments get the sums of their
// decoded fp32 copies.
template <bool kWrite, typename Moments, typename Grad, typename Load, typename LoadPack>
__device__ __forceinline__ void lamb_moments_chunk(Grad* grad, const Moments& moments, int n,
                                                   bool aligned, const LambStep& step, Load load,
                                                   LoadPack load_pack, float& param_sq,
                                                   float& update_sq) {
  constexpr int kPack = 4;
  // A thread adds at most 64K / 512 = 128 squares of each in fp32, each in one FMA, as
  // l2norm does (and for its reason).
  const auto element = [&](int i) {
    const float g = unscaled_grad<kWrite>(grad, i, step.grad_scale);
    const float p = load(i);
    float mi, vi;
    moments.load(i, mi, vi);
    const float u = lamb_moments(g, p, mi, vi, step);
    moments.store(i, mi, vi);
    param_sq = __fmaf_rn(p, p, param_sq);
    update_sq = __fmaf_rn(u, u, update_sq);
  };
  // As update_chunk: the grad pack is unscaled (and stored back) before the rest is loaded.
  const auto pack = [&](int i) {
    float g[kPack];
    unscaled_grad_pack<kWrite>(grad, i, step.grad_scale, g);
    const LambF4 pp = load_pack(i);
    LambF4 mm, vv;
    moments.load_pack(i, mm, vv);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const float u = lamb_moments(g[j], pp.v[j], mm.v[j], vv.v[j], step);
      param_sq = __fmaf_rn(pp.v[j], pp.v[j], param_sq);
      update_sq = __fmaf_rn(u, u, update_sq);
    }
    moments.store_pack(i, mm, vv);
  };
  visit_chunk<kPack>(n, aligned && is_aligned_16(grad) && moments.packs_aligned(), pack, element);
}

// The first pass over this block's chunk of `table` (lists as kLambMasterList says), with the
// chunk's moments in `moments`: the new moments and the chunk's sums of squares of the fp32
// param and of the update, left in chunk_sums[2 * c] and [2 * c + 1], c the chunk's number across
// the whole call, with its tensor (its index in the full list) in chunk_owner[c]. The param is
// only read; the grads are written unscaled with write_grads.
template <int Depth, typename Moments>
__device__ void lamb_moments_block(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                   const Moments& moments, bool has_master, bool write_grads,
                                   MasterMode mode, const LambStep& step, float* chunk_sums,
                                   std::int32_t* chunk_owner) {
  float param_sq = 0.0f;
  float update_sq = 0.0f;
  if (mode != MasterMode::kFp32) {
    // The value the mode holds; the stores are the second pass's.
    with_bf16_chunk(table, chunk, write_grads, mode, [&](auto* grad, auto write, auto kind) {
      constexpr MasterMode kMode = decltype(kind)::value;
      constexpr bool kStochastic = kMode == MasterMode::kStochastic;
      using Bits4 = Pack<std::uint16_t, 4>;
      const auto* param =
          static_cast<const std::uint16_t*>(table.addresses[0][chunk.slot]) + chunk.start;
      const auto* extra =
          static_cast<const std::uint16_t*>(table.addresses[kLambMasterList][chunk.slot]) +
          chunk.start;
      const auto load = [&](int i) {
        return Bf16Param<kMode>::load(param[i], kStochastic ? std::uint16_t{0} : extra[i]);
      };
      const auto load_pack = [&](int i) {
        const Bits4 pp = *reinterpret_cast<const Bits4*>(param + i);
        const Bits4 ee = kStochastic ? Bits4{} : *reinterpret_cast<const Bits4*>(extra + i);
        LambF4 out;
#pragma unroll
        for (int j = 0; j < 4; ++j) out.v[j] = Bf16Param<kMode>::load(pp.v[j], ee.v[j]);
        return out;
      };
      // The alignment test of the fp32 path with the extra array in the master's place, so
      // that both walk a chunk alike.
      const bool aligned = is_aligned_16(param) && (kStochastic || is_aligned_16(extra));
      lamb_moments_chunk<decltype(write)::value>(grad, moments, chunk.size, aligned, step, load,
                                                 load_pack, param_sq, update_sq);
    });
  } else {
    const float* master = has_master ? fp32_list(table, chunk, kLambMasterList) : nullptr;
    with_param_and_grad(table, chunk, write_grads, [&](auto* param, auto* grad, auto write) {
      using Param = std::remove_pointer_t<decltype(param)>;
      const auto load = [&](int i) {
        return master != nullptr ? master[i] : DeviceElement<Param>::load(param[i]);
      };
      const auto load_pack = [&](int i) {
        if (master != nullptr) return *reinterpret_cast<const LambF4*>(master + i);
        const Pack<Param, 4> raw = *reinterpret_cast<const Pack<Param, 4>*>(param + i);
        LambF4 out;
#pragma unroll
        for (int j = 0; j < 4; ++j) out.v[j] = DeviceElement<Param>::load(raw.v[j]);
        return out;
      };
      const bool aligned = is_aligned_16(param) && (master == nullptr || is_aligned_16(master));
      lamb_moments_chunk<decltype(write)::value>(grad, moments, chunk.size, aligned, step, load,
                                                 load_pack, param_sq, update_sq);
    });
  }
  param_sq = block_sum(param_sq);
  update_sq = block_sum(update_sq);
  if (threadIdx.x == 0) {
    const std::int64_t index = table.first_chunk + blockIdx.x;
    chunk_sums[2 * index] = param_sq;
    chunk_sums[2 * index + 1] = update_sq;
    chunk_owner[index] = table.list_index[chunk.slot];
  }
}

// A step's launches in order (lamb.cu): the prologue (constants; the count advances unless
// part is kMoments), then first_pass() (which fills chunk_sums and chunk_owner for every chunk
// of `params`) and the kernel that turns each tensor's chunk sums into its trust ratio in
// `ratios` and/or its two sums in tensor_sums; or, in kApply, the ratios from tensor_sums; then
// second_pass(ratio_refs), ratio_refs[t] being tensor t's ratio as a one-element list entry. The
// passes are not called where they have no chunk, nor the second in kMoments, nor, with
// first_pass_only_sums (the first pass writes nothing the second reads), the first where no
// ratio needs the sums. The arguments are lamb()'s (cuda_kernels.h); `op` names the op in errors.
void run_lamb_passes(const char* op, const std::vector<TensorRef>& params, const LambConfig& config,
                     const StepScalars& scalars, const float* grad_norm, LambStep* constants,
                     float* chunk_sums, std::int32_t* chunk_owner, float* ratios,
                     StreamHandle stream, LambPart part, double* tensor_sums,
                     bool first_pass_only_sums, const std::function<void()>& first_pass,
                     const std::function<void(const std::vector<TensorRef>&)>& second_pass);

}  // namespace ampfuse::kernels::cuda
