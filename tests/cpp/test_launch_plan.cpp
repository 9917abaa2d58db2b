// Launch planning: every chunk of every tensor lands in exactly one block, the
// per-launch caps hold, and a tensor cut by a full table continues correctly.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "launch_plan.h"

using namespace ampfuse::kernels;

namespace {

struct Visit {
  std::int32_t tensor;
  std::int64_t chunk;
  std::int64_t global_chunk;
};

// Plans `sizes` at the given depth and returns the chunk every block owns, in launch order.
// Per-block checks are gathered into one flag: plans of a million blocks stay fast.
template <int Depth>
std::vector<Visit> plan(const std::vector<std::int64_t>& sizes, int* launches = nullptr) {
  std::vector<std::vector<TensorRef>> lists(Depth);
  for (int d = 0; d < Depth; ++d) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      // Fake, distinct addresses per list and tensor: only their identity is checked.
      void* address =
          reinterpret_cast<void*>((d + 1) * 0x100000000LL + static_cast<long long>(i) * 0x1000);
      lists[d].push_back({address, sizes[i], d == 0 ? DType::kFloat16 : DType::kFloat32});
    }
  }
  const std::vector<TensorRef>* pointers[Depth];
  for (int d = 0; d < Depth; ++d) pointers[d] = &lists[d];
  std::vector<Visit> visits;
  int count = 0;
  plan_launches<Depth>(pointers, [&](const ChunkTable<Depth>& table, int blocks) {
    ++count;
    REQUIRE(blocks >= 1);
    REQUIRE(blocks <= kMaxBlocksPerLaunch);
    REQUIRE(table.first_chunk == static_cast<std::int64_t>(visits.size()));
    REQUIRE(table.tensors >= 1);
    REQUIRE(table.tensors <= ChunkTable<Depth>::kMaxTensors);
    REQUIRE(table.first_block[0] == 0);
    for (int slot = 0; slot < table.tensors; ++slot) {
      const std::int32_t tensor = table.list_index[slot];
      REQUIRE(table.numel[slot] == sizes[tensor]);
      for (int d = 0; d < Depth; ++d) {
        REQUIRE(table.addresses[d][slot] == lists[d][tensor].data);
        REQUIRE(table.dtypes[d][slot] == lists[d][tensor].dtype);
      }
      // Every slot owns at least one of this launch's blocks.
      const std::int32_t next = slot + 1 < table.tensors ? table.first_block[slot + 1] : blocks;
      REQUIRE(table.first_block[slot] < next);
    }
    bool in_range = true;
    for (int b = 0; b < blocks; ++b) {
      const SlotChunk owned = chunk_of_block(table, b);
      in_range &= owned.slot >= 0 && owned.slot < table.tensors && owned.chunk >= 0 &&
                  owned.chunk < chunks_of(table.numel[owned.slot]);
      visits.push_back({table.list_index[owned.slot], owned.chunk, table.first_chunk + b});
    }
    REQUIRE(in_range);
  });
  if (launches) *launches = count;
  return visits;
}

// Every chunk of every tensor is owned by exactly one block, in list order.
template <int Depth>
void check_covers_every_chunk(const std::vector<std::int64_t>& sizes) {
  const auto visits = plan<Depth>(sizes);
  std::size_t k = 0;
  bool in_order = true;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::int64_t c = 0; c < chunks_of(sizes[i]); ++c, ++k) {
      in_order &= k < visits.size() && visits[k].tensor == std::int32_t(i) &&
                  visits[k].chunk == c && visits[k].global_chunk == std::int64_t(k);
    }
  }
  REQUIRE(in_order);
  REQUIRE(visits.size() == k);
}

// Parameter sizes of a GPT-style model of about `total` elements, as
// benchmarks/_timing.py's model_like_shapes builds them: 24 layers of 12 tensors, a
// token embedding and a final layer norm, 291 tensors.
std::vector<std::int64_t> model_like_sizes(std::int64_t total) {
  constexpr std::int64_t kLayers = 24;
  const auto root = static_cast<std::int64_t>(std::sqrt(0.75 * total / (12 * kLayers)));
  const std::int64_t d = std::max<std::int64_t>(16, root / 16 * 16);
  const std::vector<std::int64_t> layer = {3 * d * d, 3 * d, d * d,     d, d, d,
                                           4 * d * d, 4 * d, 4 * d * d, d, d, d};
  std::vector<std::int64_t> sizes;
  for (std::int64_t l = 0; l < kLayers; ++l) sizes.insert(sizes.end(), layer.begin(), layer.end());
  std::int64_t used = 2 * d;
  for (std::int64_t s : sizes) used += s;
  sizes.insert(sizes.begin(), std::max<std::int64_t>(1, (total - used) / d) * d);
  sizes.push_back(d);
  sizes.push_back(d);
  return sizes;
}

}  // namespace

TEST_CASE("chunk counts at the 64K boundary") {
  REQUIRE(chunks_of(0) == 0);
  REQUIRE(chunks_of(1) == 1);
  REQUIRE(chunks_of(65535) == 1);
  REQUIRE(chunks_of(65536) == 1);
  REQUIRE(chunks_of(65537) == 2);
  REQUIRE(chunks_of(std::int64_t{3} << 31) == (std::int64_t{3} << 31) / 65536);
}

TEST_CASE("sizes at chunk boundaries are covered exactly once") {
  check_covers_every_chunk<1>({65535, 65536, 65537, 1, 0, 3 * 65536 + 7});
  check_covers_every_chunk<2>({65535, 65536, 65537, 1, 0, 3 * 65536 + 7});
  check_covers_every_chunk<5>({65535, 65536, 65537, 1, 0, 3 * 65536 + 7});
}

TEST_CASE("the per-depth tensor caps fill the 32 KB parameter budget") {
  // Deeper tables hold fewer tensors; each still fits the budget (static_asserts in
  // launch_plan.h) and leaves room for the functor's arguments.
  REQUIRE(ChunkTable<1>::kMaxTensors > ChunkTable<2>::kMaxTensors);
  REQUIRE(ChunkTable<5>::kMaxTensors > ChunkTable<6>::kMaxTensors);
  REQUIRE(ChunkTable<6>::kMaxTensors >= 400);
  REQUIRE(sizeof(ChunkTable<1>) > 30 * 1024);
  REQUIRE(sizeof(ChunkTable<6>) > 30 * 1024);
  REQUIRE(kMaxKernelParamBytes - sizeof(ChunkTable<6>) >= 1000);
}

TEST_CASE("lists longer than the per-launch tensor cap split into launches") {
  const int cap = ChunkTable<1>::kMaxTensors;
  for (int count : {cap - 1, cap, cap + 1, 3 * cap + 5}) {
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(count), 10);
    int launches = 0;
    plan<1>(sizes, &launches);
    REQUIRE(launches == (count + cap - 1) / cap);
    check_covers_every_chunk<1>(sizes);
    check_covers_every_chunk<6>(sizes);
  }
}

TEST_CASE("a tensor larger than one launch continues in the next") {
  // Two full launches of blocks from one tensor and a bit: it spans three launches, the
  // last of which also holds the tensor after it.
  const std::int64_t blocks = kMaxBlocksPerLaunch;
  const std::vector<std::int64_t> sizes = {5, (2 * blocks + 7) * kChunkSize - 3, 9};
  int launches = 0;
  plan<3>(sizes, &launches);
  REQUIRE(launches == 3);
  check_covers_every_chunk<3>(sizes);
}

TEST_CASE("the block cap splits launches of many multi-chunk tensors") {
  // 100 tensors of 100 chunks, under the tensor cap: the blocks run out mid-tensor.
  const std::vector<std::int64_t> sizes(100, 100 * kChunkSize);
  int launches = 0;
  plan<4>(sizes, &launches);
  REQUIRE(launches == (100 * 100 + kMaxBlocksPerLaunch - 1) / kMaxBlocksPerLaunch);
  REQUIRE(launches == 2);
  check_covers_every_chunk<4>(sizes);
}

TEST_CASE("a tensor that fills the last block of a launch starts no empty slot") {
  const std::vector<std::int64_t> sizes = {std::int64_t{kMaxBlocksPerLaunch} * kChunkSize, 1, 1};
  int launches = 0;
  plan<2>(sizes, &launches);
  REQUIRE(launches == 2);
  check_covers_every_chunk<2>(sizes);
}

TEST_CASE("a 300-tensor model takes one launch per op") {
  // 291 tensors, 125M and 350M elements: every list op, Adam's six lists included, runs
  // in a single launch. The 4 KB tables (320 blocks, 96 to 32 tensors) took 7 to 11
  // launches per op at 125M and 18 at 350M.
  for (std::int64_t total : {std::int64_t{125'000'000}, std::int64_t{350'000'000}}) {
    const auto sizes = model_like_sizes(total);
    REQUIRE(sizes.size() == 291);
    int launches[6] = {};
    plan<1>(sizes, &launches[0]);
    plan<2>(sizes, &launches[1]);
    plan<4>(sizes, &launches[3]);
    plan<6>(sizes, &launches[5]);
    INFO("total " << total);
    REQUIRE(launches[0] == 1);
    REQUIRE(launches[1] == 1);
    REQUIRE(launches[3] == 1);
    REQUIRE(launches[5] == 1);
  }
}

TEST_CASE("empty lists and empty tensors launch nothing") {
  int launches = -1;
  REQUIRE(plan<1>({}, &launches).empty());
  REQUIRE(launches == 0);
  REQUIRE(plan<2>({0, 0, 0}, &launches).empty());
  REQUIRE(launches == 0);
}
