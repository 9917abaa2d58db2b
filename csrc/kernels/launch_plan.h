// Host-side planning of multi-tensor launches, shared by the CUDA launchers and
// exercised by the C++ tests (it needs no GPU).
//
// A launch carries a ChunkTable in its kernel arguments: the addresses of up to
// kMaxTensors tensors per list and, for each tensor, the first block that works on it.
// Blocks own consecutive 64K-element chunks, so a block finds its tensor by a binary
// search over those first blocks (chunk_of_block). With no per-block entries in the
// table, the block cap per launch is a free choice (kMaxBlocksPerLaunch).
//
// The table is sized for the 32 KB kernel-parameter limit of CUDA 12.1+ on Volta and
// newer (CMakeLists.txt refuses older toolkits and architectures; the launcher checks
// the driver). The tensor cap per launch follows from the table's byte budget and the
// number of parallel lists (the depth).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtype.h"

namespace ampfuse::kernels {

constexpr std::int64_t kChunkSize = 65536;
// CUDA 12.1+ accepts up to 32,764 bytes of kernel parameters on sm_70 and newer.
constexpr std::size_t kMaxKernelParamBytes = 32764;
// The table's share of them; the rest is for the functor and the scalar arguments
// (launch_multi_tensor checks the sum when it instantiates a kernel).
constexpr std::size_t kChunkTableBytes = 31 * 1024;
// Blocks (chunks) in one launch. The table puts no bound on it; this cap keeps the path
// that continues a tensor in the next launch reachable by a GPU test (a 1 GB fp16
// tensor), while a 350M-parameter model (5,574 chunks) still fits one launch, and a
// launch that hits the cap has 512M elements of work to cover the next launch's cost.
constexpr std::int32_t kMaxBlocksPerLaunch = 8192;

// Table bytes per tensor: an address and a dtype per list, numel, list index, first block.
constexpr std::size_t table_bytes_per_tensor(int depth) {
  return static_cast<std::size_t>(depth) * (sizeof(void*) + sizeof(DType)) + sizeof(std::int64_t) +
         2 * sizeof(std::int32_t);
}

// Room for the fixed fields (first_chunk, slot0_first_chunk, tensors) and padding.
constexpr int max_tensors_per_launch(int depth) {
  return static_cast<int>((kChunkTableBytes - 32) / table_bytes_per_tensor(depth));
}

template <int Depth>
struct ChunkTable {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth);
  void* addresses[Depth][kMaxTensors];
  std::int64_t numel[kMaxTensors];
  // Chunk number, across the whole call, of this launch's block 0; blocks own
  // consecutive chunks, so block b owns chunk first_chunk + b.
  std::int64_t first_chunk;
  // Chunk of tensor slot 0 that block 0 owns: nonzero when slot 0 is a tensor
  // continued from the previous launch.
  std::int64_t slot0_first_chunk;
  // Index of each table slot in the caller's full list (per-tensor outputs).
  std::int32_t list_index[kMaxTensors];
  // First block of each slot; strictly increasing, since every tensor has a chunk.
  std::int32_t first_block[kMaxTensors];
  std::int32_t tensors;
  // Each tensor's element type: lists may mix dtypes, and a block branches once
  // (uniformly) on its tensor's type, so no op needs to group tensors by dtype.
  DType dtypes[Depth][kMaxTensors];
};

// Every table the kernels use (depth 1 to 6) fits its budget.
static_assert(sizeof(ChunkTable<1>) <= kChunkTableBytes, "kernel parameter budget");
static_assert(sizeof(ChunkTable<2>) <= kChunkTableBytes, "kernel parameter budget");
static_assert(sizeof(ChunkTable<3>) <= kChunkTableBytes, "kernel parameter budget");
static_assert(sizeof(ChunkTable<4>) <= kChunkTableBytes, "kernel parameter budget");
static_assert(sizeof(ChunkTable<5>) <= kChunkTableBytes, "kernel parameter budget");
static_assert(sizeof(ChunkTable<6>) <= kChunkTableBytes, "kernel parameter budget");

constexpr std::int64_t chunks_of(std::int64_t numel) {
  return (numel + kChunkSize - 1) / kChunkSize;
}

// Total number of chunks over a list (empty tensors own none).
inline std::int64_t total_chunks(const std::vector<TensorRef>& list) {
  std::int64_t total = 0;
  for (const TensorRef& t : list) total += chunks_of(t.numel);
  return total;
}

// A block's work: the table slot of its tensor and the chunk of that tensor.
struct SlotChunk {
  int slot;
  std::int64_t chunk;
};

// Which slot and chunk `block` owns. constexpr so that device code calls the same function
// (nvcc's --expt-relaxed-constexpr); every thread of a block reads the same entries, which
// the constant cache serves to the whole warp at once.
template <int Depth>
constexpr SlotChunk chunk_of_block(const ChunkTable<Depth>& table, std::int32_t block) {
  int lo = 0, hi = table.tensors - 1;  // the last slot whose first block is <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int64_t chunk =
      block - table.first_block[lo] + (lo == 0 ? table.slot0_first_chunk : 0);
  return {lo, chunk};
}

// Walks every chunk of every non-empty tensor in order and calls
// launch(table, num_blocks) each time the table runs out of tensor slots or
// blocks, and once at the end. `lists[d][i]` is tensor i of list d; all lists
// have the same length and list 0's numel is authoritative. A tensor that is
// cut off by a full table continues in the next launch.
template <int Depth, typename Launch>
void plan_launches(const std::vector<TensorRef>* const lists[Depth], Launch&& launch) {
  ChunkTable<Depth> table{};
  std::int32_t blocks = 0;
  std::int64_t chunks_done = 0;
  const auto flush = [&] {
    launch(static_cast<const ChunkTable<Depth>&>(table), static_cast<int>(blocks));
    chunks_done += blocks;
    table.first_chunk = chunks_done;
    table.slot0_first_chunk = 0;
    table.tensors = 0;
    blocks = 0;
  };
  const std::vector<TensorRef>& first = *lists[0];
  for (std::size_t i = 0; i < first.size(); ++i) {
    const std::int64_t numel = first[i].numel;
    if (numel == 0) continue;
    if (table.tensors == ChunkTable<Depth>::kMaxTensors || blocks == kMaxBlocksPerLaunch) flush();
    const int slot = table.tensors++;
    for (int d = 0; d < Depth; ++d) {
      table.addresses[d][slot] = (*lists[d])[i].data;
      table.dtypes[d][slot] = (*lists[d])[i].dtype;
    }
    table.numel[slot] = numel;
    table.list_index[slot] = static_cast<std::int32_t>(i);
    table.first_block[slot] = blocks;
    const std::int64_t chunks = chunks_of(numel);
    std::int64_t planned = 0;
    while (true) {
      const std::int64_t take =
          std::min<std::int64_t>(chunks - planned, kMaxBlocksPerLaunch - blocks);
      blocks += static_cast<std::int32_t>(take);
      planned += take;
      if (planned == chunks) break;
      // The table is out of blocks with this tensor unfinished: it goes on as slot 0.
      flush();
      for (int d = 0; d < Depth; ++d) {
        table.addresses[d][0] = table.addresses[d][slot];
        table.dtypes[d][0] = table.dtypes[d][slot];
      }
      table.numel[0] = numel;
      table.list_index[0] = static_cast<std::int32_t>(i);
      table.first_block[0] = 0;
      table.slot0_first_chunk = planned;
      table.tensors = 1;
    }
  }
  if (blocks > 0) flush();
}

}  // namespace ampfuse::kernels
