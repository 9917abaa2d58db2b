// fused_adam_coded_: fused_adam_ with Adam's moments held as 8-bit block codes
// (state_codes.h). Each 256 threads of a CTA own one block of kStateBlock (256) elements at a
// time, one element per thread: they decode its moments, run the element update of fused_adam_
// (optimizer_math.h, the master modes of bf16_modes.h), take the absmax of the new coded values
// (warp max, then the block's warps through shared memory) and code them again. One element
// per thread keeps the update within the list kernels' 64 registers: a warp per block held
// 8 elements of three moments per lane and spilled 500+ bytes a thread (ptxas, sm_90). An
// overflow skips everything; the prologue advances the step count once.
#include "optimizer_step.cuh"
#include "state_codes.h"

namespace ampfuse::kernels::cuda {
namespace {

// Lists in the table: 0 params, 1 grads, 2-4 the codes of exp_avg, exp_avg_sq, max_exp_avg_sq,
// 5 masters (or a bf16 mode's extra array), 6-8 the scales of the three moments.
constexpr int kCodedDepth = 9;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kStateBlock / kWarp;
constexpr int kBlocksAtOnce = kThreadsPerBlock / kStateBlock;  // code blocks a CTA works on
static_assert(kChunkSize % kStateBlock == 0, "a chunk holds whole code blocks");
static_assert(kThreadsPerBlock % kStateBlock == 0, "a CTA holds whole code blocks");

// The absmax of a coded value as bits: |x|'s bits order like its values, nan above inf, so
// an unsigned max keeps a nan, as encode_block's compare does. Which nan differs: this keeps
// the largest bits, encode_block the last one. The scale's nan bits are not part of the
// contract (tests/python/adam_coded_cases.py's assert_same_bits lets a nan equal any nan).
__device__ __forceinline__ std::uint32_t magnitude_bits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

__device__ __forceinline__ std::uint32_t warp_max(std::uint32_t x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const std::uint32_t other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

// The param of a chunk read and written as fp32: its master when there is one, else itself.
template <typename Param>
struct PlainParam {
  Param* param;
  float* master;
  __device__ float load(int i) const {
    return master != nullptr ? master[i] : DeviceElement<Param>::load(param[i]);
  }
  __device__ void store(int i, float p) const {
    if (master != nullptr) master[i] = p;
    param[i] = DeviceElement<Param>::store(p);
  }
};

// A bf16 param without an fp32 master (bf16_modes.h), through Bf16Chunk.
template <MasterMode kMode>
struct ModeParam {
  Bf16Chunk<kMode> bf16;
  __device__ float load(int i) const {
    return bf16.value(bf16.param[i], Bf16Chunk<kMode>::kStochastic ? std::uint16_t{0}
                                                                    : bf16.extra[i]);
  }
  __device__ void store(int i, float p) const {
    std::uint16_t param_bits, extra_bits;
    bf16.bits(p, i, param_bits, extra_bits);
    bf16.param[i] = param_bits;
    if constexpr (!Bf16Chunk<kMode>::kStochastic) bf16.extra[i] = extra_bits;
  }
};

template <int Depth>
__device__ std::uint8_t* code_list(const ChunkTable<Depth>& table, const BlockChunk& chunk,
                                   int d) {
  return static_cast<std::uint8_t*>(table.addresses[d][chunk.slot]) + chunk.start;
}

template <int Depth>
__device__ float* scale_list(const ChunkTable<Depth>& table, const BlockChunk& chunk, int d) {
  return static_cast<float*>(table.addresses[d][chunk.slot]) + chunk.start / kStateBlock;
}

// One moment of the element a thread owns: its codes and scales at the chunk's start.
template <StateCode kCode, bool kSecond>
struct ChunkMoment {
  std::uint8_t* codes;
  float* scales;
  __device__ float decode(int i) const {
    return decode_moment<kCode, kSecond>(codes[i], scales[i / kStateBlock]);
  }
  __device__ void encode(int i, float value, float absmax) const {
    codes[i] = encode_moment<kCode, kSecond>(coded_value<kSecond>(value), absmax);
  }
};

// Every block of the chunk: decode, update each element, encode. The loop bound is the same
// for every thread of the CTA (the barrier needs them all); a thread past its block's end
// holds nothing and adds 0 to the max.
// Each warp's max of each moment, two buffers: a block's maxima are read between the barrier
// of its round and the next round's barrier, while the next round writes the other buffer, so
// one barrier per round suffices. Declared once per kernel (the functor), not per variant of
// coded_chunk: each variant's own __shared__ array would count toward the CTA's shared memory.
using WarpMaxima = std::uint32_t[2][kBlocksAtOnce][kWarpsPerBlock][3];

template <StateCode kCode, bool kAmsgrad, bool kWriteGrad, typename Grad, typename ParamAccess>
__device__ void coded_chunk(const ChunkTable<kCodedDepth>& table, const BlockChunk& chunk,
                            Grad* grad, const ParamAccess& param, const AdamStep& step,
                            WarpMaxima& warp_maxima) {
  constexpr int kMoments = kAmsgrad ? 3 : 2;
  const int t = static_cast<int>(threadIdx.x);
  const int group = t / kStateBlock;
  const int lane = t % kWarp;
  const int warp = t % kStateBlock / kWarp;
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
#pragma unroll
    for (int k = 0; k < kMoments; ++k) {
      const std::uint32_t bits =
          owned ? magnitude_bits(k == 0 ? coded_value<false>(moments[k])
                                        : coded_value<true>(moments[k]))
                : 0u;
      const std::uint32_t warp_bits = warp_max(bits);
      if (lane == 0) warp_maxima[buffer][group][warp][k] = warp_bits;
    }
    __syncthreads();
    float absmax[3];
#pragma unroll
    for (int k = 0; k < kMoments; ++k) {
      std::uint32_t bits = 0;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        const std::uint32_t b = warp_maxima[buffer][group][w][k];
        bits = b > bits ? b : bits;
      }
      absmax[k] = __uint_as_float(bits);
    }
    if (owned) {
      m.encode(i, moments[0], absmax[0]);
      v.encode(i, moments[1], absmax[1]);
      if (kAmsgrad) max_v.encode(i, moments[2], absmax[2]);
      if (i % kStateBlock == 0) {
        const int block = i / kStateBlock;
        m.scales[block] = absmax[0];
        v.scales[block] = absmax[1];
        if (kAmsgrad) max_v.scales[block] = absmax[2];
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
    __shared__ WarpMaxima warp_maxima;
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
