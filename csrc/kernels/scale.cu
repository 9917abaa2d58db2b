// multi_tensor_scale_ and multi_tensor_unscale_: one element body, dst = src * factor
// in fp32 with a non-finite check on src, used in place (unscale) or between two
// lists of any fp32/fp16/bf16 pairing (scale); multi_tensor_nonfinite_check_: the same
// check on a list that is only read. All three can name the tensors that held inf/nan
// (tensor_flags, written only by threads that saw one).
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "nonfinite_kind.h"

namespace ampfuse::kernels::cuda {
namespace {

// The kind of a loaded element (nonfinite_kind.h): 0 when finite.
__device__ inline std::uint32_t element_kind(float x) { return nonfinite_kind(__float_as_uint(x)); }

// The kinds of the elements of a pack, ORed: the slow path, for a pack known to hold inf/nan.
template <typename T, int N>
__device__ std::uint32_t pack_kinds(const Pack<T, N>& pack) {
  std::uint32_t kinds = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) kinds |= element_kind(DeviceElement<T>::load(pack.v[k]));
  return kinds;
}

// Returns the kinds of non-finite source elements this thread saw (0: none). A pack is
// tested for inf/nan a 32-bit word at a time (nonfinite_lanes); only a pack that holds one
// has its elements examined one by one to tell which kinds, so a clean step pays three integer
// operations per word for the check instead of several per element.
template <typename Src, typename Dst>
__device__ std::uint32_t scale_chunk(const Src* src, Dst* dst, int n, float factor) {
  constexpr int kPack = 16 / (sizeof(Src) < sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
  using SrcPack = Pack<Src, kPack>;
  std::uint32_t kinds = 0;
  const auto element = [&](int i) {
    const float x = DeviceElement<Src>::load(src[i]);
    kinds |= element_kind(x);
    dst[i] = DeviceElement<Dst>::store(x * factor);
  };
  const auto load = [&](int i) { return *reinterpret_cast<const SrcPack*>(src + i); };
  const auto use = [&](int i, const SrcPack& in) {
    if (nonfinite_lanes(in) != 0) kinds |= pack_kinds(in);
    Pack<Dst, kPack> out;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      out.v[k] = DeviceElement<Dst>::store(DeviceElement<Src>::load(in.v[k]) * factor);
    }
    *reinterpret_cast<Pack<Dst, kPack>*>(dst + i) = out;
  };
  visit_chunk_batched<kPack, SrcPack>(n, is_aligned_16(src) && is_aligned_16(dst), load, use,
                                      element);
  return kinds;
}

// Returns the kinds of non-finite elements this thread saw (0: none), testing packs as
// scale_chunk does.
template <typename T>
__device__ std::uint32_t check_chunk(const T* data, int n) {
  constexpr int kPack = 16 / sizeof(T);
  using TPack = Pack<T, kPack>;
  std::uint32_t kinds = 0;
  const auto element = [&](int i) { kinds |= element_kind(DeviceElement<T>::load(data[i])); };
  const auto load = [&](int i) { return *reinterpret_cast<const TPack*>(data + i); };
  const auto use = [&](int, const TPack& in) {
    if (nonfinite_lanes(in) != 0) kinds |= pack_kinds(in);
  };
  visit_chunk_batched<kPack, TPack>(n, is_aligned_16(data), load, use, element);
  return kinds;
}

// Only threads that saw a non-finite value write anything, so a clean step makes no global
// write and no atomic. Every such thread writes the same 1.0f to found_inf: the race is benign.
// The per-tensor flag (when asked for) takes an atomic OR, since threads that saw an inf and
// threads that saw a nan may meet on one tensor.
__device__ void flag_nonfinite(std::uint32_t kinds, float* found_inf, std::int32_t* tensor_flags,
                               std::int32_t tensor) {
  if (kinds == 0) return;
  *found_inf = 1.0f;
  if (tensor_flags != nullptr) atomicOr(tensor_flags + tensor, static_cast<int>(kinds));
}

struct UnscaleFunctor {
  static constexpr int kMinBlocksPerSm = 3;  // 40 registers, no spills on sm_90
  __device__ void operator()(const ChunkTable<1>& table, float* found_inf,
                             std::int32_t* tensor_flags, const float* inv_scale) const {
    const BlockChunk chunk = block_chunk(table);
    const float factor = *inv_scale;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* type_tag) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      T* data = static_cast<T*>(table.addresses[0][chunk.slot]) + chunk.start;
      flag_nonfinite(scale_chunk(data, data, chunk.size, factor), found_inf, tensor_flags,
                     table.list_index[chunk.slot]);
    });
  }
};

struct ScaleFunctor {
  static constexpr int kMinBlocksPerSm = 3;  // 40 registers, no spills on sm_90
  __device__ void operator()(const ChunkTable<2>& table, float* found_inf,
                             std::int32_t* tensor_flags, const float* scale) const {
    const BlockChunk chunk = block_chunk(table);
    const float factor = *scale;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* src_tag) {
      using Src = std::remove_pointer_t<decltype(src_tag)>;
      with_element_type(table.dtypes[1][chunk.slot], [&](auto* dst_tag) {
        using Dst = std::remove_pointer_t<decltype(dst_tag)>;
        const Src* src = static_cast<const Src*>(table.addresses[0][chunk.slot]) + chunk.start;
        Dst* dst = static_cast<Dst*>(table.addresses[1][chunk.slot]) + chunk.start;
        flag_nonfinite(scale_chunk(src, dst, chunk.size, factor), found_inf, tensor_flags,
                       table.list_index[chunk.slot]);
      });
    });
  }
};

struct NonfiniteCheckFunctor {
  static constexpr int kMinBlocksPerSm = 4;  // 32 registers, no spills on sm_90
  __device__ void operator()(const ChunkTable<1>& table, float* found_inf,
                             std::int32_t* tensor_flags) const {
    // A set flag is never cleared, so a block that finds it set has nothing left to decide
    // and skips reading its chunk, unless the caller asked which tensors overflowed. Blocks
    // racing with the write that sets it just read their chunk: the outcome is 1 either way.
    if (tensor_flags == nullptr && *found_inf != 0.0f) return;
    const BlockChunk chunk = block_chunk(table);
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* type_tag) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      const T* data = static_cast<const T*>(table.addresses[0][chunk.slot]) + chunk.start;
      flag_nonfinite(check_chunk(data, chunk.size), found_inf, tensor_flags,
                     table.list_index[chunk.slot]);
    });
  }
};

}  // namespace

void nonfinite_check(const std::vector<TensorRef>& tensors, float* found_inf,
                     std::int32_t* tensor_flags, StreamHandle stream) {
  const std::vector<TensorRef>* lists[1] = {&tensors};
  launch_multi_tensor<1>("multi_tensor_nonfinite_check_", lists, stream, NonfiniteCheckFunctor{},
                         found_inf, tensor_flags);
}

void unscale(const std::vector<TensorRef>& grads, float* found_inf, const float* inv_scale,
             std::int32_t* tensor_flags, StreamHandle stream) {
  const std::vector<TensorRef>* lists[1] = {&grads};
  launch_multi_tensor<1>("multi_tensor_unscale_", lists, stream, UnscaleFunctor{}, found_inf,
                         tensor_flags, inv_scale);
}

void scale(const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst, const float* scale,
           float* found_inf, std::int32_t* tensor_flags, StreamHandle stream) {
  const std::vector<TensorRef>* lists[2] = {&src, &dst};
  launch_multi_tensor<2>("multi_tensor_scale_", lists, stream, ScaleFunctor{}, found_inf,
                         tensor_flags, scale);
}

}  // namespace ampfuse::kernels::cuda
