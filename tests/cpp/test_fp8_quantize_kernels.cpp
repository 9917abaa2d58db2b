// Current scaling's rule (current_fp8_scale) and the torch-free CPU kernels of the quantize
// ops (cpu/fp8_quantize_kernels.h), against values worked out by hand.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/fp8_quantize_kernels.h"
#include "fp8_math.h"

using ampfuse::kernels::current_fp8_scale;
using ampfuse::kernels::DType;
using ampfuse::kernels::Fp8Format;
using ampfuse::kernels::scale_to_fp8;

TEST_CASE("current scaling: fp8_max / amax / margin, 1 for zero, nan for non-finite, clamped") {
  CHECK(current_fp8_scale(2.0f, 448.0f, 1.0f) == 224.0f);
  CHECK(current_fp8_scale(2.0f, 448.0f, 4.0f) == 56.0f);
  CHECK(current_fp8_scale(0.0f, 448.0f, 1.0f) == 1.0f);
  CHECK(std::isnan(current_fp8_scale(INFINITY, 448.0f, 1.0f)));
  CHECK(std::isnan(current_fp8_scale(NAN, 57344.0f, 1.0f)));
  CHECK(current_fp8_scale(1e-45f, 448.0f, 1.0f) == std::numeric_limits<float>::max());
  CHECK(current_fp8_scale(3e38f, 448.0f, std::ldexp(1.0f, 64)) ==
        std::numeric_limits<float>::min());
}

TEST_CASE("cast + transpose writes both layouts and returns the amax bits") {
  const std::vector<float> src = {1.0f, -2.0f, 3.0f, 0.5f, NAN, -1000.0f};  // [2, 3]
  std::vector<std::uint8_t> out(6), out_t(6);
  const std::uint32_t bits = ampfuse::kernels::cpu::fp8_cast_transpose_rows(
      src.data(), DType::kFloat32, 2, 3, 0, 2, 1.0f, Fp8Format::kE4M3, out.data(), out_t.data());
  CHECK(bits == ampfuse::kernels::abs_bits(NAN));
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 3; ++c) {
      CHECK(out[r * 3 + c] == scale_to_fp8<Fp8Format::kE4M3>(src[r * 3 + c], 1.0f));
      CHECK(out_t[c * 2 + r] == out[r * 3 + c]);
    }
  }
  CHECK(out[5] == 0xfe);  // -1000 saturates to -448
}

TEST_CASE("column sums and rowwise scales") {
  const std::vector<float> src = {1.0f, 2.0f, 0.0f, 4.0f, -8.0f, 0.0f};  // [2, 3]
  std::vector<float> sums(3);
  ampfuse::kernels::cpu::fp8_column_sums(src.data(), DType::kFloat32, 2, 3, 0, 3, sums.data());
  CHECK(sums == std::vector<float>{5.0f, -6.0f, 0.0f});
  std::vector<std::uint8_t> out(6);
  std::vector<float> scale_inv(2);
  ampfuse::kernels::cpu::fp8_quantize_rows(src.data(), DType::kFloat32, 3, 0, 2, Fp8Format::kE4M3,
                                           out.data(), scale_inv.data());
  CHECK(scale_inv[0] == 1.0f / 224.0f);  // row amax 2
  CHECK(scale_inv[1] == 1.0f / 56.0f);   // row amax 8
  CHECK(out[1] == scale_to_fp8<Fp8Format::kE4M3>(448.0f, 1.0f));
  std::vector<std::uint8_t> out_t(6);
  std::vector<float> col_inv(3);
  ampfuse::kernels::cpu::fp8_quantize_columns_transposed(
      src.data(), DType::kFloat32, 2, 3, 0, 3, Fp8Format::kE4M3, out_t.data(), col_inv.data());
  CHECK(col_inv == std::vector<float>{1.0f / 112.0f, 1.0f / 56.0f, 1.0f});  // amax 4, 8, 0
  CHECK(out_t[1 * 2 + 1] == scale_to_fp8<Fp8Format::kE4M3>(-448.0f, 1.0f));
}
