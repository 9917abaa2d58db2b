// Launch planning: every chunk of every tensor lands in exactly one block, the
// per-launch caps hold, and a tensor cut by a full table continues correctly.
#include <catch2/catch.hpp>

#include <map>
#include <utility>
#include <vector>

#include "launch_plan.h"

using namespace ampfuse::kernels;

namespace {

struct Visit {
  std::int32_t tensor;
  std::int64_t chunk;
  std::int64_t global_chunk;
};

template <int Depth>
std::vector<Visit> plan(const std::vector<std::int64_t>& sizes, int* launches = nullptr) {
  std::vector<std::vector<TensorRef>> lists(Depth);
  for (int d = 0; d < Depth; ++d) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      // Fake, distinct addresses per list and tensor: only their identity is checked.
      void* address = reinterpret_cast<void*>((d + 1) * 0x100000000LL + static_cast<long long>(i) * 0x1000);
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
    for (int b = 0; b < blocks; ++b) {
      const int slot = table.block_tensor[b];
      REQUIRE(slot < ChunkTable<Depth>::kMaxTensors);
      const std::int32_t tensor = table.list_index[slot];
      for (int d = 0; d < Depth; ++d) {
        REQUIRE(table.addresses[d][slot] == lists[d][tensor].data);
        REQUIRE(table.dtypes[d][slot] == lists[d][tensor].dtype);
      }
      REQUIRE(table.numel[slot] == sizes[tensor]);
      visits.push_back({tensor, table.block_chunk[b], table.first_chunk + b});
    }
  });
  if (launches) *launches = count;
  return visits;
}

template <int Depth>
void check_covers_every_chunk(const std::vector<std::int64_t>& sizes) {
  int launches = 0;
  const auto visits = plan<Depth>(sizes, &launches);
  std::vector<std::pair<std::int32_t, std::int64_t>> expected;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::int64_t c = 0; c < chunks_of(sizes[i]); ++c) expected.emplace_back(std::int32_t(i), c);
  }
  REQUIRE(visits.size() == expected.size());
  for (std::size_t k = 0; k < visits.size(); ++k) {
    REQUIRE(visits[k].tensor == expected[k].first);  // list order is kept
    REQUIRE(visits[k].chunk == expected[k].second);
    REQUIRE(visits[k].global_chunk == static_cast<std::int64_t>(k));
  }
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

TEST_CASE("lists longer than the per-launch tensor cap split into launches") {
  for (int count : {95, 96, 97, 250, 1000}) {
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(count), 10);
    int launches = 0;
    plan<1>(sizes, &launches);
    const int cap = ChunkTable<1>::kMaxTensors;
    REQUIRE(launches == (count + cap - 1) / cap);
    check_covers_every_chunk<1>(sizes);
    check_covers_every_chunk<4>(sizes);
  }
}

TEST_CASE("a tensor larger than one launch continues in the next") {
  // 700 chunks: more than two launches' worth of blocks from one tensor.
  const std::vector<std::int64_t> sizes = {5, 700 * 65536 - 3, 9};
  int launches = 0;
  plan<3>(sizes, &launches);
  REQUIRE(launches == 3);
  check_covers_every_chunk<3>(sizes);
}

TEST_CASE("the block cap splits launches of many multi-chunk tensors") {
  std::vector<std::int64_t> sizes(90, 4 * 65536);  // 360 blocks, under the tensor cap of 96
  int launches = 0;
  plan<1>(sizes, &launches);
  REQUIRE(launches == 2);
  check_covers_every_chunk<1>(sizes);
}

TEST_CASE("empty lists and empty tensors launch nothing") {
  int launches = -1;
  REQUIRE(plan<1>({}, &launches).empty());
  REQUIRE(launches == 0);
  REQUIRE(plan<2>({0, 0, 0}, &launches).empty());
  REQUIRE(launches == 0);
}
