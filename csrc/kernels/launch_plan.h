// Host-side planning of multi-tensor launches, shared by the CUDA launchers and
// exercised by the C++ tests (it needs no GPU).
//
// A launch carries a ChunkTable in its kernel arguments: the addresses of up to
// kMaxTensors tensors per list and, for each of up to kMaxBlocks blocks, which
// tensor and which 64K-element chunk of it that block owns. The table must fit
// the classic 4 KB kernel-parameter budget, so the tensor cap shrinks as the
// number of parallel lists (the depth) grows.
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"

namespace ampfuse::kernels {

constexpr std::int64_t kChunkSize = 65536;
constexpr int kMaxBlocksPerLaunch = 320;

constexpr int max_tensors_per_launch(int depth) {
  return depth == 1 ? 96 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 40 : 32;
}

template <int Depth>
struct ChunkTable {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth);
  void* addresses[Depth][kMaxTensors];
  // Each tensor's element type: lists may mix dtypes, and a block branches once
  // (uniformly) on its tensor's type, so no op needs to group tensors by dtype.
  DType dtypes[Depth][kMaxTensors];
  std::int64_t numel[kMaxTensors];
  // Index of each table slot in the caller's full list (per-tensor outputs).
  std::int32_t list_index[kMaxTensors];
  // Chunk number, across the whole call, of this launch's block 0; blocks own
  // consecutive chunks, so block b owns chunk first_chunk + b.
  std::int64_t first_chunk;
  std::uint8_t block_tensor[kMaxBlocksPerLaunch];
  std::int32_t block_chunk[kMaxBlocksPerLaunch];
};

static_assert(sizeof(ChunkTable<1>) <= 4000, "kernel argument budget");
static_assert(sizeof(ChunkTable<2>) <= 4000, "kernel argument budget");
static_assert(sizeof(ChunkTable<3>) <= 4000, "kernel argument budget");
static_assert(sizeof(ChunkTable<4>) <= 4000, "kernel argument budget");
static_assert(sizeof(ChunkTable<5>) <= 4000, "kernel argument budget");
static_assert(sizeof(ChunkTable<6>) <= 4000, "kernel argument budget");
static_assert(max_tensors_per_launch(1) <= 255, "block_tensor is a uint8");

constexpr std::int64_t chunks_of(std::int64_t numel) {
  return (numel + kChunkSize - 1) / kChunkSize;
}

// Total number of chunks over a list (empty tensors own none).
inline std::int64_t total_chunks(const std::vector<TensorRef>& list) {
  std::int64_t total = 0;
  for (const TensorRef& t : list) total += chunks_of(t.numel);
  return total;
}

// Walks every chunk of every non-empty tensor in order and calls
// launch(table, num_blocks) each time the table runs out of tensor slots or
// blocks, and once at the end. `lists[d][i]` is tensor i of list d; all lists
// have the same length and list 0's numel is authoritative. A tensor that is
// cut off by a full table continues in the next launch.
template <int Depth, typename Launch>
void plan_launches(const std::vector<TensorRef>* const lists[Depth], Launch&& launch) {
  ChunkTable<Depth> table{};
  int tensors = 0;
  int blocks = 0;
  std::int64_t chunks_done = 0;
  const std::vector<TensorRef>& first = *lists[0];
  for (std::size_t i = 0; i < first.size(); ++i) {
    const std::int64_t numel = first[i].numel;
    if (numel == 0) continue;
    for (int d = 0; d < Depth; ++d) {
      table.addresses[d][tensors] = (*lists[d])[i].data;
      table.dtypes[d][tensors] = (*lists[d])[i].dtype;
    }
    table.numel[tensors] = numel;
    table.list_index[tensors] = static_cast<std::int32_t>(i);
    ++tensors;
    const std::int64_t chunks = chunks_of(numel);
    for (std::int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<std::uint8_t>(tensors - 1);
      table.block_chunk[blocks] = static_cast<std::int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      const bool blocks_full = blocks == kMaxBlocksPerLaunch;
      const bool tensors_full = tensors == ChunkTable<Depth>::kMaxTensors && last_chunk;
      if (!blocks_full && !tensors_full) continue;
      launch(table, blocks);
      chunks_done += blocks;
      table.first_chunk = chunks_done;
      blocks = 0;
      if (last_chunk) {
        tensors = 0;
      } else {
        // The current tensor is unfinished: it becomes slot 0 of the next table.
        for (int d = 0; d < Depth; ++d) {
          table.addresses[d][0] = table.addresses[d][tensors - 1];
          table.dtypes[d][0] = table.dtypes[d][tensors - 1];
        }
        table.numel[0] = table.numel[tensors - 1];
        table.list_index[0] = table.list_index[tensors - 1];
        tensors = 1;
      }
    }
  }
  if (blocks > 0) launch(table, blocks);
}

}  // namespace ampfuse::kernels
