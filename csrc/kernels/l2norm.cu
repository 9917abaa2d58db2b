// multi_tensor_l2norm: each block writes the sum of squares of its chunk and the
// list index of the chunk's tensor; a finishing kernel adds the chunk sums in a
// fixed order, so the result is deterministic and needs no atomics.
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace ampfuse::kernels::cuda {
namespace {

struct ChunkSumOfSquaresFunctor {
  static constexpr int kMinBlocksPerSm = 4;  // 32 registers, no spills on sm_90
  __device__ void operator()(const ChunkTable<1>& table, float* chunk_sums,
                             std::int32_t* chunk_owner) const {
    const BlockChunk chunk = block_chunk(table);
    float sum = 0.0f;
    with_element_type(table.dtypes[0][chunk.slot], [&](auto* type_tag) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int kPack = 16 / sizeof(T);
      const T* data = static_cast<const T*>(table.addresses[0][chunk.slot]) + chunk.start;
      // A thread adds at most 64K / 512 = 128 squares in fp32: short enough that
      // its rounding error stays near one ulp of the chunk sum. Each square is added in one
      // FMA, on purpose and written out: a sum's order differs from the CPU's anyway, and the
      // contraction check (tests/python/test_cuda_contraction.py) then holds every implicit
      // a * b + c elsewhere to the CPU's rounding.
      const auto element = [&](int i) {
        const float x = DeviceElement<T>::load(data[i]);
        sum = __fmaf_rn(x, x, sum);
      };
      using TPack = Pack<T, kPack>;
      const auto load = [&](int i) { return *reinterpret_cast<const TPack*>(data + i); };
      const auto use = [&](int, const TPack& in) {
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const float x = DeviceElement<T>::load(in.v[k]);
          sum = __fmaf_rn(x, x, sum);
        }
      };
      // Several loads in flight per thread; the squares are added in the same order.
      visit_chunk_batched<kPack, TPack>(chunk.size, is_aligned_16(data), load, use, element);
    });
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
      const std::int64_t index = table.first_chunk + blockIdx.x;
      chunk_sums[index] = sum;
      chunk_owner[index] = table.list_index[chunk.slot];
    }
  }
};

// Block 0 reduces every chunk into the global norm; block 1 + t reduces tensor t's
// chunks. Chunk sums are added in double: cheap here, and it keeps the global norm
// of billions of elements accurate.
__global__ void __launch_bounds__(kThreadsPerBlock)
    finish_l2norm_kernel(const float* chunk_sums, const std::int32_t* chunk_owner,
                         std::int64_t chunks, float* global_norm, float* per_tensor_norms) {
  std::int64_t begin = 0, end = chunks;
  if (blockIdx.x > 0) {
    const auto tensor = static_cast<std::int32_t>(blockIdx.x - 1);
    begin = first_chunk_of(chunk_owner, chunks, tensor);
    end = first_chunk_of(chunk_owner, chunks, tensor + 1);
  }
  double sum = 0.0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) sum += chunk_sums[i];
  sum = block_sum(sum);
  if (threadIdx.x != 0) return;
  const auto norm = static_cast<float>(sqrt(sum));
  if (blockIdx.x == 0) {
    *global_norm = norm;
  } else {
    per_tensor_norms[blockIdx.x - 1] = norm;
  }
}

}  // namespace

std::int64_t l2norm_scratch_chunks(const std::vector<TensorRef>& tensors) {
  return total_chunks(tensors);
}

void l2norm(const std::vector<TensorRef>& tensors, float* chunk_sums, std::int32_t* chunk_owner,
            float* global_norm, float* per_tensor_norms, StreamHandle stream) {
  const std::vector<TensorRef>* lists[1] = {&tensors};
  launch_multi_tensor<1>("multi_tensor_l2norm", lists, stream, ChunkSumOfSquaresFunctor{},
                         chunk_sums, chunk_owner);
  const std::int64_t finish_blocks =
      1 + (per_tensor_norms != nullptr ? static_cast<std::int64_t>(tensors.size()) : 0);
  finish_l2norm_kernel<<<static_cast<unsigned>(finish_blocks), kThreadsPerBlock, 0,
                         reinterpret_cast<cudaStream_t>(stream)>>>(
      chunk_sums, chunk_owner, total_chunks(tensors), global_norm, per_tensor_norms);
  throw_on_launch_error("multi_tensor_l2norm (finish)");
}

}  // namespace ampfuse::kernels::cuda
