// The FP8 CUDA launchers (fp8_cast.cu, fp8_cast_transpose.cu, fp8_current_scaling.cu,
// fp8_transpose.cu), run on the CPU by emulated_cuda.h, against the CPU kernels the op layer
// runs on the CPU: the same codes, amaxes and scales bit for bit. Sizes and offsets are picked
// to take every path: vector and scalar loads, ragged edge tiles, several blocks, empty inputs,
// inf / nan at the first, a middle and the last element.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/fp8_kernels.h"
#include "cpu/fp8_quantize_kernels.h"
#include "emulated_buffers.h"
#include "fp8_math.h"
#define cuda emulated_cuda
#include "fp8_cuda.h"
#undef cuda

namespace {

using namespace ampfuse::kernels;
using emulated_test::Bytes;
using emulated_test::Elements;
using fp8_detail::bits_of;
using fp8_detail::float_of;
using test::same;

constexpr DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

const char* name(DType d) {
  return d == DType::kFloat32 ? "fp32" : d == DType::kFloat16 ? "fp16" : "bf16";
}

// Where a test plants a non-finite value: nowhere, or at the first, a middle or the last element.
enum class Plant { kNone, kFirstNan, kMiddleInf, kLastNegInf, kLastNan };
constexpr Plant kPlants[] = {Plant::kNone, Plant::kFirstNan, Plant::kMiddleInf, Plant::kLastNegInf,
                             Plant::kLastNan};

void plant(Elements& e, Plant p) {
  const std::int64_t n = e.numel();
  if (n == 0) return;
  switch (p) {
    case Plant::kNone:
      break;
    case Plant::kFirstNan:
      e.set(0, NAN);
      break;
    case Plant::kMiddleInf:
      e.set(n / 2, INFINITY);
      break;
    case Plant::kLastNegInf:
      e.set(n - 1, -INFINITY);
      break;
    case Plant::kLastNan:
      e.set(n - 1, -NAN);
      break;
  }
}

std::uint32_t folded(float start, std::uint32_t span_bits) {
  return std::max(abs_bits(start), span_bits);
}

// Floats compare with test::same: equal bits, where a nan equals any nan. CUDA's fp16 -> fp32
// conversion (__half2float, whose host version in cuda_fp16.hpp mirrors the device's cvt) gives
// the canonical nan 0x7fffffff whatever the fp16 nan's sign and payload, where the CPU keeps
// both: the amax and the nan code's sign may then differ, a nan either way.

bool is_nan_code(std::uint8_t c, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? (c & 0x7f) == 0x7f : (c & 0x7f) > 0x7c;
}

// How many codes differ, a nan code matching any nan code.
std::int64_t differing_codes(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                             Fp8Format format) {
  std::int64_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    differ += a[i] != b[i] && !(is_nan_code(a[i], format) && is_nan_code(b[i], format));
  }
  return differ;
}

}  // namespace

TEST_CASE("emulated CUDA fp8_cast_amax: the CPU's codes and amax, every path") {
  // 4096 fp32 / 8192 half elements fill one block's unrolled vector pass; 70001 takes 18-35
  // blocks and a tail past the last whole vector.
  const std::int64_t sizes[] = {1, 7, 4099, 70001};
  const float starts[] = {0.0f, -0.0f, 5.0f, -NAN};
  int case_index = 0;
  for (DType dtype : kDtypes) {
    for (Fp8Format format : kFormats) {
      for (std::int64_t n : sizes) {
        for (int offset : {0, 1}) {
          const Plant p = kPlants[case_index % 5];
          const float start = starts[case_index % 4];
          ++case_index;
          CAPTURE(name(dtype), static_cast<int>(format), n, offset, static_cast<int>(p), start);
          Elements src(dtype, n, offset);
          src.fill(static_cast<std::uint32_t>(case_index), 600.0f);
          plant(src, p);
          const float scale = 0.75f;
          Bytes got(n, offset), want(n, offset);
          float amax = start;
          emulated_cuda::fp8_cast_amax(TensorRef{src.data(), n, dtype}, got.data(), &scale, &amax,
                                       format, nullptr);
          const std::uint32_t span =
              cpu::fp8_cast_amax_span(src.data(), dtype, want.data(), n, scale, format);
          CHECK(differing_codes(got.copy(n), want.copy(n), format) == 0);
          CHECK(got.guards_intact(n));
          CHECK(same(amax, float_of(folded(start, span))));
        }
      }
    }
  }
}

TEST_CASE("emulated CUDA fp8_cast_amax of nothing clears a -0.0 or negative-nan amax's sign") {
  for (float start : {-0.0f, -NAN, 3.0f}) {
    float amax = start;
    const float scale = 1.0f;
    emulated_cuda::fp8_cast_amax(TensorRef{nullptr, 0, DType::kFloat32}, nullptr, &scale, &amax,
                                 Fp8Format::kE4M3, nullptr);
    CHECK(bits_of(amax) == abs_bits(start));
  }
}

TEST_CASE("emulated CUDA fp8_tensor_scale: the CPU's amax, scale and scale_inv") {
  const std::int64_t sizes[] = {1, 9, 1000, 40003};
  int case_index = 0;
  for (DType dtype : kDtypes) {
    for (std::int64_t n : sizes) {
      for (int offset : {0, 1}) {
        const Plant p = kPlants[case_index % 5];
        ++case_index;
        CAPTURE(name(dtype), n, offset, static_cast<int>(p));
        Elements src(dtype, n, offset);
        src.fill(static_cast<std::uint32_t>(100 + case_index), 3.0f);
        plant(src, p);
        float amax = -7.0f;  // ignored: the launcher zeroes it first
        float scale = 0.0f;
        float scale_inv = 0.0f;
        const float margin = case_index % 2 ? 1.0f : 4.0f;
        emulated_cuda::fp8_tensor_scale(TensorRef{src.data(), n, dtype}, &amax, &scale, &scale_inv,
                                        448.0f, margin, nullptr);
        const std::uint32_t want_amax = cpu::fp8_amax_span(src.data(), dtype, n);
        const float want_scale = current_fp8_scale(fp8_detail::float_of(want_amax), 448.0f, margin);
        CHECK(same(amax, float_of(want_amax)));
        CHECK(same(scale, want_scale));
        CHECK(same(scale_inv, fp8_detail::div_rn(1.0f, want_scale)));
      }
    }
  }
  float amax = 1.0f, scale = 0.0f, scale_inv = 0.0f;
  emulated_cuda::fp8_tensor_scale(TensorRef{nullptr, 0, DType::kFloat32}, &amax, &scale, &scale_inv,
                                  448.0f, 1.0f, nullptr);
  CHECK(bits_of(amax) == 0u);
  CHECK(scale == 1.0f);
  CHECK(scale_inv == 1.0f);
}

namespace {

struct Shape {
  std::int64_t rows, cols;
};
// Whole 64 x 64 tiles, ragged edges, sizes that are and are not multiples of 16 (the vector
// loads and the 16-byte transposed stores), one row, one column.
constexpr Shape kShapes[] = {{1, 1},   {64, 64},  {65, 130}, {128, 48}, {33, 16},
                             {16, 33}, {200, 96}, {1, 300},  {300, 1}};

// dbias as the CUDA kernels order it: each 64-row tile's column sums from 0.0f, rows past the
// input adding 0.0f, then the tiles' sums added in order.
std::vector<float> tiled_column_sums(const Elements& src, std::int64_t rows, std::int64_t cols) {
  std::vector<float> dbias(static_cast<std::size_t>(cols));
  for (std::int64_t c = 0; c < cols; ++c) {
    float total = 0.0f;
    for (std::int64_t t = 0; t * 64 < rows; ++t) {
      float tile = 0.0f;
      for (std::int64_t r = t * 64; r < t * 64 + 64; ++r) {
        tile += r < rows ? src.get(r * cols + c) : 0.0f;
      }
      total += tile;
    }
    dbias[static_cast<std::size_t>(c)] = total;
  }
  return dbias;
}

}  // namespace

TEST_CASE("emulated CUDA fp8_cast_transpose[_dbias]: the CPU's codes in both layouts") {
  int case_index = 0;
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      for (int offset : {0, 1}) {
        for (bool with_dbias : {false, true}) {
          const Plant p = kPlants[case_index % 5];
          const Fp8Format format = kFormats[case_index % 2];
          const float start = case_index % 3 == 0 ? -0.0f : 1.0f;
          ++case_index;
          const std::int64_t n = s.rows * s.cols;
          CAPTURE(name(dtype), s.rows, s.cols, offset, with_dbias, static_cast<int>(p));
          Elements src(dtype, n, offset);
          src.fill(static_cast<std::uint32_t>(200 + case_index), 500.0f);
          plant(src, p);
          const float scale = 0.5f;
          float amax = start;
          Bytes out(n, offset), out_t(n, offset), want(n), want_t(n);
          std::vector<float> dbias(static_cast<std::size_t>(s.cols), -1.0f);
          std::vector<float> workspace(
              static_cast<std::size_t>(emulated_cuda::fp8_dbias_workspace_floats(s.rows, s.cols)));
          emulated_cuda::fp8_cast_transpose(
              {src.data(), dtype, s.rows, s.cols, &scale, &amax, out.data(), out_t.data(),
               with_dbias ? dbias.data() : nullptr, with_dbias ? workspace.data() : nullptr,
               format},
              nullptr);
          const std::uint32_t span =
              cpu::fp8_cast_transpose_rows(src.data(), dtype, s.rows, s.cols, 0, s.rows, scale,
                                           format, want.data(), want_t.data());
          CHECK(differing_codes(out.copy(n), want.copy(n), format) == 0);
          CHECK(differing_codes(out_t.copy(n), want_t.copy(n), format) == 0);
          CHECK(out.guards_intact(n));
          CHECK(out_t.guards_intact(n));
          CHECK(same(amax, float_of(folded(start, span))));
          if (with_dbias) {
            const std::vector<float> tiled = tiled_column_sums(src, s.rows, s.cols);
            for (std::int64_t c = 0; c < s.cols; ++c) {
              const float g = dbias[static_cast<std::size_t>(c)];
              const float w = tiled[static_cast<std::size_t>(c)];
              CHECK(same(g, w));
            }
          }
        }
      }
    }
  }
}

// Hidden (run with "[large]"): more tile rows than gridDim.y takes (65535 tiles of 64 rows), so
// the launcher goes in bands, the second starting at row 65535 * 64, and dbias's workspace rows
// follow the global tile row. 16 columns (and rows a multiple of 16) take the 16-byte paths, 3
// the element ones. About 40 s here.
TEST_CASE("emulated CUDA fp8_cast_transpose_dbias taller than one grid", "[.][large]") {
  for (std::int64_t cols : {3, 16}) {
    CAPTURE(cols);
    const std::int64_t rows = 65535 * 64 + 80;
    const std::int64_t n = rows * cols;
    Elements src(DType::kBFloat16, n);
    src.fill(7, 100.0f);
    const float scale = 0.25f;
    float amax = -0.0f;
    Bytes out(n), out_t(n), want(n), want_t(n);
    std::vector<float> dbias(static_cast<std::size_t>(cols));
    std::vector<float> workspace(
        static_cast<std::size_t>(emulated_cuda::fp8_dbias_workspace_floats(rows, cols)));
    emulated_cuda::fp8_cast_transpose(
        {src.data(), DType::kBFloat16, rows, cols, &scale, &amax, out.data(), out_t.data(),
         dbias.data(), workspace.data(), Fp8Format::kE5M2},
        nullptr);
    const std::uint32_t span =
        cpu::fp8_cast_transpose_rows(src.data(), DType::kBFloat16, rows, cols, 0, rows, scale,
                                     Fp8Format::kE5M2, want.data(), want_t.data());
    CHECK(out.copy(n) == want.copy(n));
    CHECK(out_t.copy(n) == want_t.copy(n));
    CHECK(bits_of(amax) == span);
    const std::vector<float> tiled = tiled_column_sums(src, rows, cols);
    for (std::int64_t c = 0; c < cols; ++c) {
      CHECK(bits_of(dbias[static_cast<std::size_t>(c)]) ==
            bits_of(tiled[static_cast<std::size_t>(c)]));
    }
  }
}

TEST_CASE("emulated CUDA fp8_cast_transpose of an empty input: amax's sign cleared, dbias zeros") {
  float amax = -0.0f;
  const float scale = 1.0f;
  std::vector<float> dbias(5, 7.0f);
  emulated_cuda::fp8_cast_transpose({nullptr, DType::kFloat32, 0, 5, &scale, &amax, nullptr,
                                     nullptr, dbias.data(), nullptr, Fp8Format::kE4M3},
                                    nullptr);
  CHECK(bits_of(amax) == 0u);
  CHECK(dbias == std::vector<float>(5, 0.0f));
}

TEST_CASE("emulated CUDA fp8_quantize_rowwise: the CPU's per-row and per-column scales") {
  int case_index = 0;
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      for (int offset : {0, 1}) {
        for (bool transpose : {false, true}) {
          const Plant p = kPlants[case_index % 5];
          const Fp8Format format = kFormats[case_index % 2];
          ++case_index;
          const std::int64_t n = s.rows * s.cols;
          CAPTURE(name(dtype), s.rows, s.cols, offset, transpose, static_cast<int>(p));
          Elements src(dtype, n, offset);
          src.fill(static_cast<std::uint32_t>(300 + case_index), 50.0f);
          plant(src, p);
          // Rows of zeros: a scale of 1.
          if (s.rows > 2) {
            for (std::int64_t c = 0; c < s.cols; ++c) src.set(s.cols + c, 0.0f);
          }
          const std::int64_t scales = transpose ? s.cols : s.rows;
          Bytes out(n, offset), want(n);
          std::vector<float> scale_inv(static_cast<std::size_t>(scales), -1.0f);
          std::vector<float> want_inv(static_cast<std::size_t>(scales), -2.0f);
          std::vector<std::uint32_t> workspace(static_cast<std::size_t>(s.cols), 0xdeadbeefu);
          emulated_cuda::fp8_quantize_rowwise(src.data(), dtype, s.rows, s.cols, transpose,
                                              out.data(), scale_inv.data(), workspace.data(),
                                              format, nullptr);
          if (transpose) {
            cpu::fp8_quantize_columns_transposed(src.data(), dtype, s.rows, s.cols, 0, s.cols,
                                                 format, want.data(), want_inv.data());
          } else {
            cpu::fp8_quantize_rows(src.data(), dtype, s.cols, 0, s.rows, format, want.data(),
                                   want_inv.data());
          }
          CHECK(differing_codes(out.copy(n), want.copy(n), format) == 0);
          CHECK(out.guards_intact(n));
          for (std::int64_t i = 0; i < scales; ++i) {
            CHECK(same(scale_inv[static_cast<std::size_t>(i)],
                       want_inv[static_cast<std::size_t>(i)]));
          }
        }
      }
    }
  }
}

TEST_CASE("emulated CUDA fp8_transpose moves every byte") {
  const Shape shapes[] = {{1, 1}, {31, 33}, {32, 32}, {100, 7}, {7, 100}, {64, 96}, {1, 65}};
  for (Shape s : shapes) {
    CAPTURE(s.rows, s.cols);
    const std::int64_t n = s.rows * s.cols;
    Bytes in(n), out(n);
    for (std::int64_t i = 0; i < n; ++i) in.data()[i] = static_cast<std::uint8_t>(i * 7 + 3);
    emulated_cuda::fp8_transpose(in.data(), out.data(), s.rows, s.cols, nullptr);
    bool all_equal = true;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      for (std::int64_t c = 0; c < s.cols; ++c) {
        all_equal = all_equal && out.data()[c * s.rows + r] == in.data()[r * s.cols + c];
      }
    }
    CHECK(all_equal);
    CHECK(out.guards_intact(n));
  }
}

namespace {

// One delayed-scaling state with its own storage.
struct OwnedState {
  OwnedState(std::int64_t history_len, std::uint32_t seed)
      : history(static_cast<std::size_t>(history_len)) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(0.0f, 100.0f);
    for (float& h : history) h = dist(rng);
    if (history_len > 3) history[static_cast<std::size_t>(history_len) - 2] = 1000.0f;  // the max
    amax = dist(rng);
    scale = 2.0f;
  }
  Fp8ScaleState state() {
    return {&amax,  history.data(), static_cast<std::int64_t>(history.size()),
            &scale, &scale_inv,     448.0f};
  }
  float amax = 0.0f, scale = 0.0f, scale_inv = 0.0f;
  std::vector<float> history;
};

}  // namespace

TEST_CASE("emulated CUDA fp8_update_scales: the CPU's rolled histories and scales") {
  // History lengths around the 128-thread block's chunks; skip flags null, 0 and 1.
  const std::int64_t lengths[] = {0, 1, 2, 5, 127, 128, 129, 300, 1024};
  for (bool use_max : {true, false}) {
    for (float skip_value : {-1.0f, 0.0f, 1.0f}) {
      CAPTURE(use_max, skip_value);
      std::vector<OwnedState> got, want;
      std::uint32_t seed = 1;
      for (std::int64_t len : lengths) {
        got.emplace_back(len, seed);
        want.emplace_back(len, seed);
        ++seed;
      }
      std::vector<Fp8ScaleState> states;
      for (OwnedState& s : got) states.push_back(s.state());
      const float skip = skip_value;
      emulated_cuda::fp8_update_scales(states, 2.0f, use_max, skip_value < 0 ? nullptr : &skip,
                                       nullptr);
      for (OwnedState& s : want) update_fp8_scale(s.state(), 2.0f, use_max, skip_value > 0);
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(lengths[i]);
        CHECK(got[i].history == want[i].history);
        CHECK(bits_of(got[i].amax) == bits_of(want[i].amax));
        CHECK(bits_of(got[i].scale) == bits_of(want[i].scale));
        CHECK(bits_of(got[i].scale_inv) == bits_of(want[i].scale_inv));
      }
    }
  }
}
