// CPU span kernels: the portable loops, and the choice between them and the AVX2+F16C
// loops of cpu_kernels_avx2.cpp, made at run time from what the processor supports.
// The portable loops are branch-free so that the compiler vectorizes them for the
// baseline instruction set.
#include "cpu_kernels.h"

#include "half_convert.h"
#include "span_variants.h"

namespace ampfuse::kernels::cpu {
namespace portable {
namespace {

struct Kernels {
  // dst = src * factor; also serves unscale in place (src == dst).
  template <typename Src, typename Dst>
  static std::uint32_t scale(const Src* src, Dst* dst, std::int64_t n, float factor);

  template <typename Storage>
  static double sum_of_squares(const Storage* data, std::int64_t n);
};

// The portable loop tells inf from nan for every element (a compare and an add more than a
// bare check), since a branch would stop it vectorizing; the AVX2 loop, which most CPUs run,
// only classifies once a non-finite value is seen.
template <typename Src, typename Dst>
std::uint32_t Kernels::scale(const Src* src, Dst* dst, std::int64_t n, float factor) {
  std::uint32_t kinds = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = Element<Src>::load(src[i]);
    kinds |= nonfinite_kind(float_to_bits(x));
    dst[i] = Element<Dst>::store(x * factor);
  }
  return kinds;
}

template <typename Storage>
double Kernels::sum_of_squares(const Storage* data, std::int64_t n) {
  // kSquareLanes fp32 lanes keep the vector units busy; every kSquareFold elements the
  // lanes are folded into double accumulators, so no fp32 sum ever holds more than
  // 16 squares and the result stays within ~1e-7 of float64.
  double totals[kSquareLanes] = {};
  const std::int64_t whole = n - n % kSquareFold;
  for (std::int64_t start = 0; start < whole; start += kSquareFold) {
    float lanes[kSquareLanes] = {};
    for (std::int64_t i = start; i < start + kSquareFold; i += kSquareLanes) {
      for (std::int64_t k = 0; k < kSquareLanes; ++k) {
        const float x = Element<Storage>::load(data[i + k]);
        lanes[k] += x * x;
      }
    }
    for (std::int64_t k = 0; k < kSquareLanes; ++k) totals[k] += lanes[k];
  }
  return finish_sum_of_squares(totals, data, whole, n);
}

}  // namespace

std::uint32_t scale(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n,
                    float factor) {
  return scale_any<Kernels>(src, src_dtype, dst, dst_dtype, n, factor);
}

double sum_of_squares(const void* data, DType dtype, std::int64_t n) {
  return sum_of_squares_any<Kernels>(data, dtype, n);
}

}  // namespace portable

namespace {

// The exponent field of each storage format. A value is inf or nan exactly when every bit of
// it is set, so the check tests the stored bits and never converts to fp32: no F16C needed,
// and the AVX2 clone compares 16 fp16/bf16 or 8 fp32 elements per instruction. (Read the
// 16-bit formats through their `bits` member: GCC 12 does not vectorize a bit_cast of them.)
template <typename Storage>
struct ExponentField;

// kMagnitude: every bit but the sign. A magnitude equal to kMask is an inf, above it a nan.
template <>
struct ExponentField<float> {
  using Word = std::uint32_t;
  static constexpr Word kMask = 0x7f800000u;
  static constexpr Word kMagnitude = 0x7fffffffu;
  static Word word(float x) { return float_to_bits(x); }
};

template <>
struct ExponentField<Fp16Bits> {
  using Word = std::uint16_t;
  static constexpr Word kMask = 0x7c00u;
  static constexpr Word kMagnitude = 0x7fffu;
  static Word word(Fp16Bits x) { return x.bits; }
};

template <>
struct ExponentField<Bf16Bits> {
  using Word = std::uint16_t;
  static constexpr Word kMask = 0x7f80u;
  static constexpr Word kMagnitude = 0x7fffu;
  static Word word(Bf16Bits x) { return x.bits; }
};

struct Check {
  // Branch-free so that it vectorizes; no early exit, since the common case (all finite)
  // reads every element anyway.
  template <typename Storage>
  AMPFUSE_CPU_CLONES static bool any_nonfinite(const Storage* __restrict data, std::int64_t n) {
    using Field = ExponentField<Storage>;
    using Word = typename Field::Word;
    Word nonfinite = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const Word word = Field::word(data[i]);
      nonfinite |= static_cast<Word>((word & Field::kMask) == Field::kMask);
    }
    return nonfinite != 0;
  }

  // kHeldInf | kHeldNan over the span, from the stored bits as nonfinite_kind does for fp32.
  template <typename Storage>
  static std::uint32_t kinds(const Storage* data, std::int64_t n) {
    using Field = ExponentField<Storage>;
    std::uint32_t kinds = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto magnitude = Field::word(data[i]) & Field::kMagnitude;
      kinds |= static_cast<std::uint32_t>(magnitude >= Field::kMask) +
               static_cast<std::uint32_t>(magnitude > Field::kMask);
    }
    return kinds;
  }
};

}  // namespace

bool nonfinite_span(const void* data, DType dtype, std::int64_t n) {
  return with_storage(dtype, const_cast<void*>(data),
                      [&](auto* typed) { return Check::any_nonfinite(typed, n); });
}

std::uint32_t nonfinite_kinds_span(const void* data, DType dtype, std::int64_t n) {
  return with_storage(dtype, const_cast<void*>(data),
                      [&](auto* typed) { return Check::kinds(typed, n); });
}

// Without AVX2 and F16C (or off x86), fp16 takes the portable loops' software conversion.
#ifdef AMPFUSE_HAVE_AVX2_PATH
#define AMPFUSE_SPAN_VARIANT(call) (cpu_has_avx2_f16c() ? avx2::call : portable::call)
#else
#define AMPFUSE_SPAN_VARIANT(call) portable::call
#endif

std::uint32_t unscale_span(void* data, DType dtype, std::int64_t n, float inv_scale) {
  return AMPFUSE_SPAN_VARIANT(scale(data, dtype, data, dtype, n, inv_scale));
}

std::uint32_t scale_span(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                         std::int64_t n, float scale) {
  return AMPFUSE_SPAN_VARIANT(scale(src, src_dtype, dst, dst_dtype, n, scale));
}

double sum_of_squares_span(const void* data, DType dtype, std::int64_t n) {
  return AMPFUSE_SPAN_VARIANT(sum_of_squares(data, dtype, n));
}

#undef AMPFUSE_SPAN_VARIANT

}  // namespace ampfuse::kernels::cpu
