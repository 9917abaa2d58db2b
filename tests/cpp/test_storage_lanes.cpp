// The vector storage policies of the CPU kernels against half_convert.h's one-element
// conversions, bit for bit: the AVX2+F16C eight-lane ones (F16cLanes, vec_avx2.h) and the
// AVX-512 sixteen-lane ones (Lanes512, lanes_avx512.h). Stores take every float whose low half
// sits where rounding turns (ties to even and to odd, just either side) under every high half,
// so infinities, the values that round to them, NaNs, zeros and subnormals are all in; loads take
// every 16-bit pattern. NaNs must match bit for bit too: the kernels promise c10's canonical NaN.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/half_convert.h"
#include "cpu/lanes_avx512.h"
#include "cpu/optimizer_variants.h"

using namespace ampfuse::kernels::cpu;

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Every high half with the low halves where float -> 16-bit rounding turns.
std::vector<float> store_inputs() {
  std::vector<float> x;
  for (std::uint32_t high = 0; high < 0x10000u; ++high) {
    for (const std::uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1000u, 0xe000u}) {
      const std::uint32_t bits = (high << 16) | low;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      x.push_back(f);
    }
  }
  return x;  // 2^19 values: a multiple of 16
}

template <typename Storage>
std::vector<Storage> every_pattern() {
  std::vector<Storage> all(0x10000);
  for (std::uint32_t i = 0; i < 0x10000u; ++i) all[i] = {static_cast<std::uint16_t>(i)};
  return all;
}

template <typename Storage>
AMPFUSE_AVX2 void avx2_store(const float* x, Storage* out, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 8)
    avx2::F16cLanes<Storage>::store(out + i, Lanes8(Vec8<float>::load(x + i)));
}
template <typename Storage>
AMPFUSE_AVX2 void avx2_load(const Storage* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 8)
    Vec8<float>::store(out + i, avx2::F16cLanes<Storage>::load(in + i).v);
}
template <typename Storage>
AMPFUSE_AVX512_TARGET void avx512_store(const float* x, Storage* out, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 16) {
    avx512::Lanes512<Storage>::store(out + i, avx512::Lanes512<float>::load(x + i));
  }
}
template <typename Storage>
AMPFUSE_AVX512_TARGET void avx512_load(const Storage* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 16) {
    avx512::Lanes512<float>::store(out + i, avx512::Lanes512<Storage>::load(in + i));
  }
}

template <typename Storage, typename Store, typename Load>
void check_policy(const char* name, Store store, Load load) {
  const std::vector<float> x = store_inputs();
  std::vector<Storage> stored(x.size());
  store(x.data(), stored.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO(name << " store of float bits " << bits_of(x[i]));
    REQUIRE(stored[i].bits == Element<Storage>::store(x[i]).bits);
  }
  const std::vector<Storage> patterns = every_pattern<Storage>();
  std::vector<float> loaded(patterns.size());
  load(patterns.data(), loaded.data(), patterns.size());
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    INFO(name << " load of pattern " << i);
    REQUIRE(bits_of(loaded[i]) == bits_of(Element<Storage>::load(patterns[i])));
  }
}

}  // namespace

TEST_CASE("storage lanes: AVX2+F16C eight-lane conversions give half_convert.h's bits") {
  if (!cpu_has_avx2_f16c()) {
    WARN("this CPU has no AVX2+F16C: the eight-lane conversions do not run here");
    return;
  }
  check_policy<Bf16Bits>("avx2 bf16", avx2_store<Bf16Bits>, avx2_load<Bf16Bits>);
  check_policy<Fp16Bits>("avx2 fp16", avx2_store<Fp16Bits>, avx2_load<Fp16Bits>);
}

TEST_CASE("storage lanes: AVX-512 sixteen-lane conversions give half_convert.h's bits") {
  if (!cpu_has_avx512()) {
    WARN("this CPU has no AVX-512: the sixteen-lane conversions do not run here");
    return;
  }
  check_policy<Bf16Bits>("avx512 bf16", avx512_store<Bf16Bits>, avx512_load<Bf16Bits>);
  check_policy<Fp16Bits>("avx512 fp16", avx512_store<Fp16Bits>, avx512_load<Fp16Bits>);
}
#endif
