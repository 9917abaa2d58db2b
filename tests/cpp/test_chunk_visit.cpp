// The CUDA list kernels' per-thread walk of a chunk (chunk_visit.h) and their word-at-a-time
// inf/nan test (nonfinite_kind.h), checked on the host: both are plain functions shared with
// the device code, so every thread of a block can be simulated here.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "chunk_visit.h"
#include "cpu/half_convert.h"
#include "nonfinite_kind.h"

using namespace ampfuse::kernels;

namespace {

struct Event {
  int thread;
  bool is_pack;  // a pack's use (or an element) rather than a pack's load
  bool is_load;
  int index;
};

// Runs every thread of a `threads`-thread block over a chunk of n elements, thread by thread
// (the order of threads is free on a GPU), and returns what each call did in call order.
template <int N, int Batch>
std::vector<Event> simulate(int threads, int n, bool aligned) {
  std::vector<Event> events;
  for (int t = 0; t < threads; ++t) {
    visit_chunk_in_batches<N, Batch>(
        t, threads, n, aligned,
        [&](int i) {
          events.push_back({t, true, true, i});
          return i;  // stands for the loaded pack: use() must get its own pack's load
        },
        [&](int i, int loaded) {
          REQUIRE(loaded == i);
          events.push_back({t, true, false, i});
        },
        [&](int i) { events.push_back({t, false, false, i}); });
  }
  return events;
}

template <int N, int Batch>
void check_schedule(int threads, int n, bool aligned) {
  CAPTURE(N, Batch, threads, n, aligned);
  const std::vector<Event> events = simulate<N, Batch>(threads, n, aligned);
  const std::vector<Event> unbatched = simulate<N, 1>(threads, n, aligned);
  std::vector<int> covered(static_cast<std::size_t>(n), 0);
  std::vector<int> loaded_by(static_cast<std::size_t>(n), -1);
  const int packed_end = aligned ? n - n % N : 0;
  std::vector<Event> uses;
  for (const Event& e : events) {
    if (e.is_load) {
      REQUIRE(e.index % N == 0);
      REQUIRE(e.index + N <= packed_end);
      REQUIRE(loaded_by[e.index] == -1);  // each pack loaded once
      loaded_by[e.index] = e.thread;
      continue;
    }
    uses.push_back(e);
    if (e.is_pack) {
      REQUIRE(loaded_by[e.index] == e.thread);  // loaded, by this thread, before its use
      for (int k = 0; k < N; ++k) ++covered[e.index + k];
    } else {
      REQUIRE(e.index >= packed_end);
      ++covered[e.index];
    }
  }
  bool each_once = true;
  for (int c : covered) each_once &= c == 1;
  REQUIRE(each_once);
  // The same uses, in the same order per thread, as one pack at a time: batching changes
  // when loads are issued, never what a thread adds up or in which order.
  std::vector<Event> plain_uses;
  for (const Event& e : unbatched) {
    if (!e.is_load) plain_uses.push_back(e);
  }
  REQUIRE(uses.size() == plain_uses.size());
  bool same_order = true;
  for (std::size_t k = 0; k < uses.size(); ++k) {
    same_order &= uses[k].thread == plain_uses[k].thread &&
                  uses[k].is_pack == plain_uses[k].is_pack && uses[k].index == plain_uses[k].index;
  }
  REQUIRE(same_order);
}

// Batches really are loaded ahead: with Batch packs available, a thread's first Batch calls
// are all loads.
template <int N, int Batch>
void check_loads_first(int threads, int n) {
  const std::vector<Event> events = simulate<N, Batch>(threads, n, true);
  int leading_loads = 0;
  for (const Event& e : events) {
    if (e.thread != 0 || !e.is_load) break;
    ++leading_loads;
  }
  REQUIRE(leading_loads == Batch);
}

}  // namespace

TEST_CASE("a chunk's walk covers every element once, batched or not, in the same use order") {
  const int sizes[] = {0, 1, 7, 8, 9, 511, 4095, 4096, 4097, 3437, 12288, 16383, 65535, 65536};
  for (int n : sizes) {
    for (bool aligned : {true, false}) {
      check_schedule<8, 4>(512, n, aligned);
      check_schedule<4, 4>(512, n, aligned);
      check_schedule<8, 2>(512, n, aligned);
      check_schedule<4, 3>(96, n, aligned);
      check_schedule<8, 4>(32, n, aligned);
      check_schedule<1, 4>(64, n, aligned);
    }
  }
  check_loads_first<8, 4>(512, 65536);
  check_loads_first<4, 2>(512, 65536);
}

namespace {

bool lane_nonfinite(std::uint32_t lanes, int lane, int lane_bits) {
  return (lanes >> (lane * lane_bits + lane_bits - 1)) & 1u;
}

// The reference: the element converted to float, as the element-wise path reads it.
bool half_nonfinite(std::uint16_t h, DType dtype) {
  const float x = dtype == DType::kFloat16 ? ampfuse::kernels::cpu::fp16_to_float(h)
                                           : ampfuse::kernels::cpu::bf16_to_float(h);
  return !std::isfinite(x);
}

}  // namespace

TEST_CASE("the word test finds every fp16 and bf16 inf/nan in either lane, and nothing else") {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    CAPTURE(static_cast<int>(dtype));
    const NonfiniteWordTest test = nonfinite_word_test(dtype);
    // Every 16-bit pattern in each lane, beside partners that reach the largest magnitude,
    // an inf, a nan and zero: a carry out of one lane would show in the other.
    const std::uint16_t partners[] = {0x0000, 0x7fff, 0xffff, 0x7c00, 0x7f80,
                                      0x7bff, 0x7f7f, 0x8000, 0x3c00};
    bool all_right = true;
    for (std::uint32_t h = 0; h <= 0xffff; ++h) {
      for (std::uint16_t other : partners) {
        const std::uint32_t low_word = (std::uint32_t{other} << 16) | h;
        const std::uint32_t high_word = (h << 16) | other;
        const std::uint32_t low = nonfinite_lanes(low_word, test);
        const std::uint32_t high = nonfinite_lanes(high_word, test);
        const bool h_bad = half_nonfinite(static_cast<std::uint16_t>(h), dtype);
        const bool other_bad = half_nonfinite(other, dtype);
        all_right &= lane_nonfinite(low, 0, 16) == h_bad && lane_nonfinite(low, 1, 16) == other_bad;
        all_right &=
            lane_nonfinite(high, 1, 16) == h_bad && lane_nonfinite(high, 0, 16) == other_bad;
        all_right &= (low & ~test.signs) == 0 && (high & ~test.signs) == 0;
      }
    }
    REQUIRE(all_right);
  }
}

TEST_CASE("the word test finds every fp32 inf/nan, and nothing else") {
  const NonfiniteWordTest test = nonfinite_word_test(DType::kFloat32);
  const auto check = [&](std::uint32_t bits) {
    const bool bad = !std::isfinite(ampfuse::kernels::cpu::bits_to_float(bits));
    return (nonfinite_lanes(bits, test) != 0) == bad && (nonfinite_kind(bits) != 0) == bad;
  };
  bool all_right = true;
  // Every exponent with the mantissas at its edges, both signs: the boundary is the exponent.
  for (std::uint32_t sign : {0u, 0x80000000u}) {
    for (std::uint32_t exponent = 0; exponent <= 0xff; ++exponent) {
      for (std::uint32_t mantissa : {0u, 1u, 0x400000u, 0x7ffffeu, 0x7fffffu}) {
        all_right &= check(sign | (exponent << 23) | mantissa);
      }
    }
  }
  std::mt19937 gen(11);
  for (int k = 0; k < 1000000; ++k) all_right &= check(static_cast<std::uint32_t>(gen()));
  REQUIRE(all_right);
  REQUIRE(nonfinite_lanes(0x7f800000u, test) == 0x80000000u);  // +inf
  REQUIRE(nonfinite_lanes(0xffc00000u, test) == 0x80000000u);  // a negative nan
  REQUIRE(nonfinite_lanes(0x7f7fffffu, test) == 0u);           // the largest finite float
}
