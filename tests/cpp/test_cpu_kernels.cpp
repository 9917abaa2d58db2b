// CPU span kernels against a float64 reference, at sizes around the vector
// block and the 64K chunk, with inf/nan placed at the first, a middle and the last element.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "cpu/span_variants.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

namespace {

const std::int64_t kSizes[] = {0, 1, 15, 16, 17, 1000, 65535, 65536, 65537};

std::vector<float> random_floats(std::int64_t n, std::uint32_t seed, float spread = 1000.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-spread, spread);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// Storage for one dtype, with conversions to and from float.
struct Buffer {
  DType dtype;
  std::vector<std::uint16_t> half;
  std::vector<float> single;

  Buffer(DType d, const std::vector<float>& values) : dtype(d) {
    if (d == DType::kFloat32) {
      single = values;
    } else {
      for (float x : values)
        half.push_back(d == DType::kFloat16 ? float_to_fp16(x) : float_to_bf16(x));
    }
  }
  void* data() {
    return dtype == DType::kFloat32 ? static_cast<void*>(single.data()) : half.data();
  }
  float at(std::size_t i) const {
    if (dtype == DType::kFloat32) return single[i];
    return dtype == DType::kFloat16 ? fp16_to_float(half[i]) : bf16_to_float(half[i]);
  }
  std::uint16_t round(float x) const {
    return dtype == DType::kFloat16 ? float_to_fp16(x) : float_to_bf16(x);
  }
  bool holds(std::size_t i, float x) const {
    if (dtype == DType::kFloat32) return single[i] == x || (std::isnan(x) && std::isnan(single[i]));
    return half[i] == round(x);
  }
};

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

}  // namespace

TEST_CASE("unscale_span multiplies in fp32 and rounds once") {
  for (DType dtype : kDtypes) {
    for (std::int64_t n : kSizes) {
      Buffer buf(dtype, random_floats(n, 1));
      const Buffer before = buf;
      const bool found = unscale_span(buf.data(), dtype, n, 0.125f);
      INFO("dtype " << int(dtype) << " n " << n);
      REQUIRE_FALSE(found);
      for (std::int64_t i = 0; i < n; ++i) REQUIRE(buf.holds(i, before.at(i) * 0.125f));
    }
  }
}

TEST_CASE("unscale_span flags inf and nan at the first, a middle and the last element") {
  const float bad_values[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (DType dtype : kDtypes) {
    for (std::int64_t n : {1, 17, 65536, 65537}) {
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        for (float bad : bad_values) {
          auto values = random_floats(n, 2);
          values[static_cast<std::size_t>(where)] = bad;
          Buffer buf(dtype, values);
          INFO("dtype " << int(dtype) << " n " << n << " at " << where << " value " << bad);
          REQUIRE(unscale_span(buf.data(), dtype, n, 0.5f));
        }
      }
    }
  }
}

TEST_CASE("the span kernels tell inf from nan, wherever they are, on every implementation") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  using ScaleFn = std::uint32_t (*)(const void*, DType, void*, DType, std::int64_t, float);
  std::vector<ScaleFn> implementations = {&portable::scale};
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (cpu_has_avx2_f16c()) implementations.push_back(&avx2::scale);
#endif
  for (DType dtype : kDtypes) {
    for (std::int64_t n : {1, 15, 16, 17, 1000, 65537}) {
      REQUIRE(nonfinite_kinds_span(Buffer(dtype, random_floats(n, 3)).data(), dtype, n) == 0u);
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        // (values planted, kinds expected): a second value, when there is one, goes to the
        // element after `where` (or before it at the end), often in the same vector block.
        const std::vector<std::pair<std::vector<float>, std::uint32_t>> cases = {
            {{inf}, kHeldInf},
            {{-inf}, kHeldInf},
            {{nan}, kHeldNan},
            {{-nan}, kHeldNan},
            {{inf, nan}, kHeldInf | kHeldNan}};
        for (const auto& [planted, expected] : cases) {
          if (planted.size() > static_cast<std::size_t>(n)) continue;
          auto values = random_floats(n, 4, 1.0e4f);  // 1e4 * 0.5 stays finite in fp16
          values[static_cast<std::size_t>(where)] = planted[0];
          if (planted.size() == 2) {
            const std::int64_t next = where + 1 < n ? where + 1 : where - 1;
            values[static_cast<std::size_t>(next)] = planted[1];
          }
          INFO("dtype " << int(dtype) << " n " << n << " at " << where << " kinds " << expected);
          Buffer buf(dtype, values);
          REQUIRE(nonfinite_kinds_span(buf.data(), dtype, n) == expected);
          for (ScaleFn scale : implementations) {
            Buffer in_place(dtype, values);
            REQUIRE(scale(in_place.data(), dtype, in_place.data(), dtype, n, 0.5f) == expected);
            Buffer to_fp32(DType::kFloat32, std::vector<float>(static_cast<std::size_t>(n)));
            REQUIRE(scale(buf.data(), dtype, to_fp32.data(), DType::kFloat32, n, 2.0f) == expected);
          }
          REQUIRE(unscale_span(Buffer(dtype, values).data(), dtype, n, 0.5f) == expected);
        }
      }
    }
  }
}

TEST_CASE("no false positive on the largest finite values") {
  const std::vector<float> big = {65504.0f,
                                  -65504.0f,
                                  3.0e38f,
                                  -3.0e38f,
                                  std::numeric_limits<float>::max(),
                                  std::numeric_limits<float>::denorm_min()};
  Buffer f32(DType::kFloat32, big);
  REQUIRE_FALSE(unscale_span(f32.data(), DType::kFloat32, 6, 1.0f));
  Buffer f16(DType::kFloat16, {65504.0f, -65504.0f, 6.0e-8f});
  REQUIRE_FALSE(unscale_span(f16.data(), DType::kFloat16, 3, 1.0f));
  Buffer b16(DType::kBFloat16, {3.0e38f, -3.0e38f});
  REQUIRE_FALSE(unscale_span(b16.data(), DType::kBFloat16, 2, 1.0f));
}

TEST_CASE("nonfinite_span flags inf and nan at the first, a middle and the last element") {
  const float bad_values[] = {
      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()};
  for (DType dtype : kDtypes) {
    for (std::int64_t n : kSizes) {
      const Buffer clean(dtype, random_floats(n, 6));
      Buffer copy = clean;
      INFO("dtype " << int(dtype) << " n " << n);
      REQUIRE_FALSE(nonfinite_span(copy.data(), dtype, n));
      REQUIRE(copy.half == clean.half);  // read only
      REQUIRE(copy.single == clean.single);
      if (n == 0) continue;
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        for (float bad : bad_values) {
          auto values = random_floats(n, 7);
          values[static_cast<std::size_t>(where)] = bad;
          Buffer buf(dtype, values);
          INFO("at " << where << " value " << bad);
          REQUIRE(nonfinite_span(buf.data(), dtype, n));
          // The same verdict as the check inside unscale_span.
          REQUIRE(unscale_span(buf.data(), dtype, n, 1.0f));
        }
      }
    }
  }
}

TEST_CASE("nonfinite_span: every fp16 and bf16 bit pattern, and fp32 extremes") {
  // All 65536 16-bit patterns: flagged exactly when the value is inf or nan (NaN payloads,
  // signed NaN, subnormals and the largest finite values included).
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
      const std::uint16_t h = static_cast<std::uint16_t>(bits);
      const float x = dtype == DType::kFloat16 ? fp16_to_float(h) : bf16_to_float(h);
      INFO("dtype " << int(dtype) << " bits " << bits);
      REQUIRE(nonfinite_span(&h, dtype, 1) == !std::isfinite(x));
    }
  }
  const float finite[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), 0.0f, -0.0f};
  REQUIRE_FALSE(nonfinite_span(finite, DType::kFloat32, 5));
  const std::uint32_t nan_payload = 0x7f800001u, negative_nan = 0xffc00000u;
  for (std::uint32_t bits : {nan_payload, negative_nan}) {
    float x;
    std::memcpy(&x, &bits, 4);
    REQUIRE(nonfinite_span(&x, DType::kFloat32, 1));
  }
}

TEST_CASE("scale_span casts between every pair of dtypes") {
  for (DType from : kDtypes) {
    for (DType to : kDtypes) {
      for (std::int64_t n : kSizes) {
        const auto values = random_floats(n, 3, 100.0f);
        Buffer src(from, values);
        Buffer dst(to, std::vector<float>(static_cast<std::size_t>(n), 7.0f));
        INFO("from " << int(from) << " to " << int(to) << " n " << n);
        REQUIRE_FALSE(scale_span(src.data(), from, dst.data(), to, n, 3.0f));
        for (std::int64_t i = 0; i < n; ++i) REQUIRE(dst.holds(i, src.at(i) * 3.0f));
      }
      std::vector<float> values = random_floats(100, 4);
      values[99] = std::numeric_limits<float>::quiet_NaN();
      Buffer src(from, values), dst(to, values);
      REQUIRE(scale_span(src.data(), from, dst.data(), to, 100, 1.0f));
    }
  }
}

TEST_CASE("sum_of_squares_span matches a float64 reference") {
  for (DType dtype : kDtypes) {
    for (std::int64_t n : kSizes) {
      Buffer buf(dtype, random_floats(n, 5, 3.0f));
      double reference = 0.0;
      for (std::int64_t i = 0; i < n; ++i) reference += double(buf.at(i)) * buf.at(i);
      const double got = sum_of_squares_span(buf.data(), dtype, n);
      INFO("dtype " << int(dtype) << " n " << n);
      REQUIRE(got == Approx(reference).epsilon(5e-7).margin(1e-30));
    }
  }
}

#ifdef AMPFUSE_HAVE_AVX2_PATH
TEST_CASE("the portable and AVX2+F16C span kernels return the same bits") {
  if (!cpu_has_avx2_f16c()) {
    WARN("this CPU has no AVX2+F16C: only the portable kernels run here");
    return;
  }
  const std::int64_t sizes[] = {1, 15, 16, 17, 255, 256, 257, 4099, 65537};
  for (DType from : kDtypes) {
    for (std::int64_t n : sizes) {
      auto values = random_floats(n, 9, 1.0e4f);  // overflows fp16 at times: inf in the data
      if (n > 16) values[static_cast<std::size_t>(n / 3)] = std::numeric_limits<float>::quiet_NaN();
      const Buffer src(from, values);
      INFO("dtype " << int(from) << " n " << n);
      Buffer a = src, b = src;
      // In place, as unscale_span runs them.
      REQUIRE(portable::scale(a.data(), from, a.data(), from, n, 0.37f) ==
              avx2::scale(b.data(), from, b.data(), from, n, 0.37f));
      REQUIRE(a.half == b.half);
      REQUIRE(std::memcmp(a.single.data(), b.single.data(), a.single.size() * 4) == 0);
      const double sum_portable = portable::sum_of_squares(Buffer(src).data(), from, n);
      const double sum_avx2 = avx2::sum_of_squares(Buffer(src).data(), from, n);
      REQUIRE(std::memcmp(&sum_portable, &sum_avx2, sizeof(double)) == 0);
      for (DType to : kDtypes) {
        Buffer x(to, std::vector<float>(static_cast<std::size_t>(n), 0.0f)), y = x;
        INFO("to " << int(to));
        REQUIRE(portable::scale(Buffer(src).data(), from, x.data(), to, n, 1.5f) ==
                avx2::scale(Buffer(src).data(), from, y.data(), to, n, 1.5f));
        REQUIRE(x.half == y.half);
        REQUIRE(std::memcmp(x.single.data(), y.single.data(), x.single.size() * 4) == 0);
      }
    }
  }
}
#endif
