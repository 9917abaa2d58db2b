// Eight (or sixteen) fp32 lanes for running the shared optimizer math (optimizer_math.h) a
// vector at a time.
//
// The element updates are templates over their float type. Instantiated with Lanes8 inside an
// AVX2 function, each operation below becomes one ymm instruction (vaddps, vmulps, vdivps,
// vsqrtps, ...): IEEE-exact like its scalar form, so a lane computes the bits the scalar loop
// computes for that element. GCC vector extensions rather than intrinsics: the intrinsics need
// a target attribute on every function they are inlined through, the math templates included,
// while generic vector operations are legal in baseline code and become single AVX
// instructions once inlined into an AVX2 function (optimizer_kernels_avx2.cpp). GCC and clang
// only, as the AVX2 path is.
#pragma once

#include <cstdint>

#include "half_convert.h"

// Every function that takes or returns a Lanes8 without being AVX2 code itself must be always
// inlined (these operators, and optimizer_math.h's element functions): out of line it would take
// its vectors in memory while its AVX2 callers pass them in registers. Inlined, that baseline ABI
// (which GCC notes under -Wpsabi; CMakeLists.txt turns the note off) is never used.

namespace ampfuse::kernels::cpu {

#define AMPFUSE_LANES inline __attribute__((always_inline))

typedef float Float8 __attribute__((vector_size(32)));
typedef std::int32_t Int8 __attribute__((vector_size(32)));
typedef float Float16 __attribute__((vector_size(64)));
typedef std::int32_t Int16 __attribute__((vector_size(64)));

// The vector types of W fp32 lanes: 8 (a ymm register) or 16 (a zmm register, for the
// AVX-512 coded Adam step).
template <int W>
struct LaneVectors;
template <>
struct LaneVectors<8> {
  typedef Float8 Float;
  typedef Int8 Int;
};
template <>
struct LaneVectors<16> {
  typedef Float16 Float;
  typedef Int16 Int;
};

// A lane mask: all ones where a comparison held.
template <int W>
struct MaskN {
  typename LaneVectors<W>::Int bits;
};

template <int W>
struct LanesN {
  typedef typename LaneVectors<W>::Float FloatV;
  typedef typename LaneVectors<W>::Int IntV;
  static constexpr int kWidth = W;
  FloatV v;

  AMPFUSE_LANES LanesN() : v{} {}
  AMPFUSE_LANES LanesN(FloatV x) : v(x) {}  // NOLINT: the raw vector converts implicitly
  // A per-step constant in every lane, bit for bit (-0.0 stays -0.0, which a float `{} + x`
  // would not keep). Adding the bits to integer zeros broadcasts with one instruction, where an
  // initializer list of copies builds the vector lane by lane.
  AMPFUSE_LANES LanesN(float x)  // NOLINT: implicit, so lanes mix with per-step constants
      : v(reinterpret_cast<FloatV>(IntV{} + __builtin_bit_cast(std::int32_t, x))) {}

  friend AMPFUSE_LANES LanesN operator+(LanesN a, LanesN b) { return a.v + b.v; }
  friend AMPFUSE_LANES LanesN operator-(LanesN a, LanesN b) { return a.v - b.v; }
  friend AMPFUSE_LANES LanesN operator/(LanesN a, LanesN b) { return a.v / b.v; }
  friend AMPFUSE_LANES LanesN operator-(LanesN a) { return -a.v; }
  AMPFUSE_LANES LanesN& operator+=(LanesN b) {
    v += b.v;
    return *this;
  }
  // Ordered, as the scalar `>`: false where either lane is NaN.
  friend AMPFUSE_LANES MaskN<W> operator>(LanesN a, LanesN b) { return {a.v > b.v}; }

  // The overloads the shared math calls by name (found by argument-dependent lookup). Products
  // are only mul(), as in the shared math, and the build keeps them out of FMAs
  // (-ffp-contract=off), as for the scalar mul.
  friend AMPFUSE_LANES LanesN mul(LanesN a, LanesN b) { return a.v * b.v; }
  friend AMPFUSE_LANES LanesN square_root(LanesN a) {
    // W scalar square roots that GCC turns into one vsqrtps (with -fno-math-errno).
    LanesN r;
    for (int i = 0; i < W; ++i) r.v[i] = __builtin_sqrtf(a.v[i]);
    return r;
  }
  // A per-lane choice, on the bits, as the scalar select_float does.
  friend AMPFUSE_LANES LanesN select_float(MaskN<W> cond, LanesN a, LanesN b) {
    const IntV bits =
        (reinterpret_cast<IntV>(a.v) & cond.bits) | (reinterpret_cast<IntV>(b.v) & ~cond.bits);
    return reinterpret_cast<FloatV>(bits);
  }
};

typedef LanesN<8> Lanes8;
typedef MaskN<8> Mask8;
typedef LanesN<16> Lanes16;

// Eight elements of a storage type to and from lanes, converting one element at a time with
// half_convert.h: the portable counterpart of the AVX2+F16C Vec8 (vec_avx2.h).
template <typename Storage>
struct PortableLanes {
  static AMPFUSE_LANES Lanes8 load(const Storage* p) {
    Lanes8 x;
    for (int i = 0; i < 8; ++i) x.v[i] = Element<Storage>::load(p[i]);
    return x;
  }
  static AMPFUSE_LANES void store(Storage* p, Lanes8 x) {
    for (int i = 0; i < 8; ++i) p[i] = Element<Storage>::store(x.v[i]);
  }
};

// bf16 whole vectors at a time, as float_to_bf16 and bf16_to_float do one element (round to
// nearest even, NaN to 0x7fc0): one lane at a time, GCC assembled the lanes from scalars.
template <>
struct PortableLanes<Bf16Bits> {
  typedef std::uint16_t Half8 __attribute__((vector_size(16)));
  typedef std::uint32_t Word8 __attribute__((vector_size(32)));

  static AMPFUSE_LANES Lanes8 load(const Bf16Bits* p) {
    Half8 h;
    __builtin_memcpy(&h, p, sizeof h);
    return reinterpret_cast<Float8>(__builtin_convertvector(h, Word8) << 16);
  }
  static AMPFUSE_LANES void store(Bf16Bits* p, Lanes8 x) {
    const Word8 u = reinterpret_cast<Word8>(x.v);
    const Word8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const Word8 is_nan = reinterpret_cast<Word8>((u & 0x7fffffffu) > 0x7f800000u);
    const Half8 h = __builtin_convertvector((rounded & ~is_nan) | (0x7fc0u & is_nan), Half8);
    __builtin_memcpy(p, &h, sizeof h);
  }
};

#undef AMPFUSE_LANES

}  // namespace ampfuse::kernels::cpu
