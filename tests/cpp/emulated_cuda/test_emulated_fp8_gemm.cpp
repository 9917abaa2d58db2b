// The host code of fp8_gemm.cu and fp8_gemm_plan.cu (descriptors, layouts, scale and bias
// attributes, the plan cache, the handling of cuBLASLt's refusals) over the cuBLASLt stand-in
// of emulated_cublaslt.h, against
// fp8_cuda.h's contract written out row-major here: out[i, j] = (a[i, :] . b[j, :]) * scales
// (+ bias[j]). The stand-in computes from cuBLASLt's column-major definition, so a wrong
// transpose, operand order, scale pointer or bias side gives other numbers. Scales are powers
// of two and sums are formed in double on both sides, so the results are exact.
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "dtype.h"
#include "emulated_cublaslt.h"
#include "fp8_math.h"
#define cuda emulated_cuda
#include "fp8_cuda.h"
#undef cuda

using namespace ampfuse::kernels;
using ampfuse_emu::blaslt::behaviour;
using emulated_cuda::Fp8GemmArgs;
using emulated_cuda::Fp8GemmContext;
using emulated_cuda::Fp8ScaleMode;

namespace {

// The value of an fp8 code, from the formats' definitions (e4m3fn: bias 7, no inf; e5m2: bias
// 15, IEEE-like). The tests draw no nan or inf codes.
double fp8_value(std::uint8_t code, Fp8Format format) {
  const int sign = code >> 7 ? -1 : 1;
  const bool e4m3 = format == Fp8Format::kE4M3;
  const int mantissa_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int exponent = (code & 0x7f) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  const double m = static_cast<double>(mantissa) / (1 << mantissa_bits);
  return sign * (exponent == 0 ? std::ldexp(m, 1 - bias) : std::ldexp(1.0 + m, exponent - bias));
}

std::vector<std::uint8_t> random_codes(std::int64_t n, Fp8Format format, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
  // Exponents up to 9 (e4m3) or 17 (e5m2): no nan or inf, values up to about 4.
  const int top = format == Fp8Format::kE4M3 ? 0x4f : 0x47;
  for (auto& c : codes) c = static_cast<std::uint8_t>((rng() % (top + 1)) | (rng() % 2) << 7);
  return codes;
}

// Output elements as floats, whatever their type.
std::vector<float> outputs(const std::vector<std::uint16_t>& half, const std::vector<float>& single,
                           DType dtype) {
  if (dtype == DType::kFloat32) return single;
  std::vector<float> out;
  for (std::uint16_t h : half) {
    out.push_back(dtype == DType::kBFloat16 ? cpu::bf16_to_float(h) : cpu::fp16_to_float(h));
  }
  return out;
}

float rounded(double v, DType dtype) {
  const auto f = static_cast<float>(v);
  if (dtype == DType::kBFloat16) return cpu::bf16_to_float(cpu::float_to_bf16(f));
  if (dtype == DType::kFloat16) return cpu::fp16_to_float(cpu::float_to_fp16(f));
  return f;
}

// One GEMM's inputs, output buffer and expected output.
struct Problem {
  std::int64_t m, n, k;
  Fp8Format a_format, b_format;
  Fp8ScaleMode mode;
  DType out_dtype;
  bool with_bias;
  std::vector<std::uint8_t> a, b;
  std::vector<float> a_scale, b_scale;
  std::vector<std::uint16_t> bias, out_half;
  std::vector<float> out_single;

  Problem(std::int64_t m_, std::int64_t n_, std::int64_t k_, Fp8Format af, Fp8Format bf,
          Fp8ScaleMode mode_, DType out, bool bias_, std::uint32_t seed)
      : m(m_),
        n(n_),
        k(k_),
        a_format(af),
        b_format(bf),
        mode(mode_),
        out_dtype(out),
        with_bias(bias_),
        a(random_codes(m_ * k_, af, seed)),
        b(random_codes(n_ * k_, bf, seed + 1)) {
    const bool rowwise = mode == Fp8ScaleMode::kRowwise;
    for (std::int64_t i = 0; i < (rowwise ? m : 1); ++i)
      a_scale.push_back(std::ldexp(1.0f, i % 5 - 2));
    for (std::int64_t j = 0; j < (rowwise ? n : 1); ++j)
      b_scale.push_back(std::ldexp(1.0f, 1 - j % 4));
    for (std::int64_t j = 0; j < n; ++j) {
      const float v = 0.25f * static_cast<float>(j % 7) - 0.5f;
      bias.push_back(out == DType::kFloat16 ? cpu::float_to_fp16(v) : cpu::float_to_bf16(v));
    }
    out_half.assign(static_cast<std::size_t>(m * n), 0xffff);
    out_single.assign(static_cast<std::size_t>(m * n), NAN);
  }

  Fp8GemmArgs args() {
    return {a.data(),
            a_format,
            b.data(),
            b_format,
            m,
            n,
            k,
            a_scale.data(),
            b_scale.data(),
            mode,
            /*fast_accum=*/true,
            with_bias ? bias.data() : nullptr,
            out_dtype == DType::kFloat32 ? static_cast<void*>(out_single.data())
                                         : static_cast<void*>(out_half.data()),
            out_dtype,
            /*device=*/0};
  }

  float bias_value(std::int64_t j) const {
    const std::uint16_t h = bias[static_cast<std::size_t>(j)];
    return out_dtype == DType::kFloat16 ? cpu::fp16_to_float(h) : cpu::bf16_to_float(h);
  }

  // out[i, j] from the contract; with the bias when `biased`.
  std::vector<float> expected(bool biased) const {
    std::vector<float> want;
    const bool rowwise = mode == Fp8ScaleMode::kRowwise;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double sum = 0.0;
        for (std::int64_t p = 0; p < k; ++p) {
          sum += fp8_value(a[static_cast<std::size_t>(i * k + p)], a_format) *
                 fp8_value(b[static_cast<std::size_t>(j * k + p)], b_format);
        }
        double v = sum * a_scale[static_cast<std::size_t>(rowwise ? i : 0)] *
                   b_scale[static_cast<std::size_t>(rowwise ? j : 0)];
        if (biased) v += bias_value(j);
        want.push_back(rounded(v, out_dtype));
      }
    }
    return want;
  }

  std::vector<float> got() const { return outputs(out_half, out_single, out_dtype); }
};

struct Workspace {
  std::vector<unsigned char> bytes = std::vector<unsigned char>(1 << 16);
  Fp8GemmContext context() { return {nullptr, bytes.data(), bytes.size()}; }
};

// Deltas of the plan cache's counters and of the stand-in's calls.
struct Counters {
  emulated_cuda::Fp8GemmPlanStats stats = emulated_cuda::fp8_gemm_plan_stats();
  int queries = behaviour().heuristic_queries;
  int launches = behaviour().launches;
  std::int64_t built() const { return emulated_cuda::fp8_gemm_plan_stats().built - stats.built; }
  std::int64_t reused() const { return emulated_cuda::fp8_gemm_plan_stats().reused - stats.reused; }
  std::int64_t evicted() const {
    return emulated_cuda::fp8_gemm_plan_stats().evicted - stats.evicted;
  }
  int new_queries() const { return behaviour().heuristic_queries - queries; }
};

}  // namespace

TEST_CASE("emulated fp8_gemm: the contract's output for every format, scale mode and out dtype") {
  behaviour() = {};
  Workspace workspace;
  const Fp8Format pairs[][2] = {{Fp8Format::kE4M3, Fp8Format::kE4M3},
                                {Fp8Format::kE5M2, Fp8Format::kE4M3},
                                {Fp8Format::kE4M3, Fp8Format::kE5M2}};
  std::uint32_t seed = 1;
  for (Fp8ScaleMode mode : {Fp8ScaleMode::kTensorwise, Fp8ScaleMode::kRowwise}) {
    for (const auto& formats : pairs) {
      if (mode == Fp8ScaleMode::kRowwise && formats[0] != formats[1]) continue;
      for (DType out : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
        // The op layer adds an fp32 output's bias itself (fp8_cuda.h).
        for (bool with_bias : {false, out != DType::kFloat32}) {
          for (const auto& [m, n, k] :
               {std::array<std::int64_t, 3>{16, 32, 48}, std::array<std::int64_t, 3>{48, 16, 16}}) {
            CAPTURE(static_cast<int>(mode), static_cast<int>(formats[0]),
                    static_cast<int>(formats[1]), static_cast<int>(out), with_bias, m, n, k);
            Problem p(m, n, k, formats[0], formats[1], mode, out, with_bias, seed += 2);
            const bool fused = emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr);
            CHECK(fused == with_bias);
            CHECK(p.got() == p.expected(with_bias));
          }
        }
      }
    }
  }
}

TEST_CASE("emulated fp8_gemm: a plan is built once per problem and reused") {
  behaviour() = {};
  Workspace workspace;
  // A shape no other case uses, so that the first call builds.
  Problem p(16, 16, 96, Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8ScaleMode::kTensorwise,
            DType::kBFloat16, true, 77);
  const Counters before;
  for (int call = 0; call < 3; ++call) {
    CHECK(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
  }
  CHECK(before.built() == 1);
  CHECK(before.reused() == 2);
  CHECK(before.new_queries() == 1);
  CHECK(p.got() == p.expected(true));
  // Other pointer alignment, or another workspace size: another plan.
  Workspace smaller;
  smaller.bytes.resize(1 << 12);
  CHECK(emulated_cuda::fp8_gemm(p.args(), smaller.context(), nullptr));
  CHECK(before.built() == 2);
}

TEST_CASE("emulated fp8_gemm: without a bias kernel the GEMM runs alone and says so") {
  Workspace workspace;
  SECTION("the heuristic has no algorithm with the bias epilogue") {
    behaviour() = {};
    behaviour().no_bias_algorithm = true;
    Problem p(32, 16, 32, Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8ScaleMode::kRowwise,
              DType::kFloat16, true, 91);
    const Counters before;
    CHECK_FALSE(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
    CHECK(p.got() == p.expected(false));
    CHECK_FALSE(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
    CHECK(before.built() == 1);
    CHECK(before.new_queries() == 2);  // with the bias, then without: once
  }
  SECTION("cuBLASLt refuses the first launch with the bias epilogue") {
    behaviour() = {};
    behaviour().refuse_bias_launch = true;
    Problem p(32, 16, 64, Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8ScaleMode::kTensorwise,
              DType::kBFloat16, true, 93);
    const Counters before;
    CHECK_FALSE(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
    CHECK(p.got() == p.expected(false));
    CHECK_FALSE(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
    CHECK(before.built() == 1);
    CHECK(before.reused() == 1);
    CHECK(before.new_queries() == 2);
  }
  behaviour() = {};
}

TEST_CASE("emulated fp8_gemm: refusals are Fp8GemmUnsupported, and a refused plan is not kept") {
  Workspace workspace;
  SECTION("a cuBLASLt without outer-vector scales cannot do rowwise") {
    behaviour() = {};
    behaviour().no_outer_vector_scales = true;
    Problem p(16, 32, 32, Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8ScaleMode::kRowwise,
              DType::kBFloat16, false, 95);
    const Counters before;
    CHECK_THROWS_AS(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr),
                    emulated_cuda::Fp8GemmUnsupported);
    CHECK_THROWS_WITH(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr),
                      Catch::Contains("rowwise scales") && Catch::Contains("outer-vector"));
    CHECK(before.built() == 0);
  }
  SECTION("a first launch refused: the next call asks again") {
    behaviour() = {};
    behaviour().refuse_launch = true;
    Problem p(16, 48, 32, Fp8Format::kE4M3, Fp8Format::kE5M2, Fp8ScaleMode::kTensorwise,
              DType::kFloat32, false, 97);
    const Counters before;
    CHECK_THROWS_AS(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr),
                    emulated_cuda::Fp8GemmUnsupported);
    behaviour().refuse_launch = false;
    CHECK_FALSE(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr));
    CHECK(p.got() == p.expected(false));
    CHECK(before.built() == 2);
    CHECK(before.new_queries() == 2);
  }
  SECTION("e5m2 times e5m2 has no kernel") {
    behaviour() = {};
    Problem p(16, 16, 16, Fp8Format::kE5M2, Fp8Format::kE5M2, Fp8ScaleMode::kTensorwise,
              DType::kBFloat16, false, 99);
    CHECK_THROWS_AS(emulated_cuda::fp8_gemm(p.args(), workspace.context(), nullptr),
                    emulated_cuda::Fp8GemmUnsupported);
  }
  behaviour() = {};
}

TEST_CASE("emulated fp8_gemm: the plan cache drops its least recently used plan when full") {
  behaviour() = {};
  const Counters before;
  const std::int64_t capacity = before.stats.capacity;
  // capacity + 1 problems of one small shape, told apart by the workspace size (part of a
  // plan's key), so that each call builds a plan.
  Problem p(16, 16, 16, Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8ScaleMode::kTensorwise,
            DType::kBFloat16, false, 1000);
  Workspace workspace;
  const auto context = [&](std::int64_t i) {
    return Fp8GemmContext{nullptr, workspace.bytes.data(), 1000 + static_cast<std::size_t>(i)};
  };
  for (std::int64_t i = 0; i <= capacity; ++i)
    emulated_cuda::fp8_gemm(p.args(), context(i), nullptr);
  CHECK(before.built() == capacity + 1);
  CHECK(before.evicted() >= 1);
  // The newest plan is still there; the first one (least recently used) was dropped.
  const Counters after;
  emulated_cuda::fp8_gemm(p.args(), context(capacity), nullptr);
  CHECK(after.reused() == 1);
  emulated_cuda::fp8_gemm(p.args(), context(0), nullptr);
  CHECK(after.built() == 1);
  CHECK(p.got() == p.expected(false));
}
