// Coded moments for the tests of the fused coded optimizer steps (test_coded_adam.cpp,
// test_coded_lamb.cpp): codes and scales made from fp32 values by the portable coder.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/coded_moments.h"
#include "state_codes.h"
#include "variant_test_arrays.h"

namespace ampfuse::kernels::test {

// One coded moment: codes and one scale per block, coded from fp32 values.
struct Coded {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;

  Coded(const std::vector<float>& values, StateCode code, bool second)
      : codes(values.size()), scales((values.size() + kStateBlock - 1) / kStateBlock) {
    cpu::portable::encode_moment_span(values.data(), 0, static_cast<std::int64_t>(values.size()),
                                      code, second, codes.data(), scales.data());
  }
  bool operator==(const Coded& other) const {
    return codes == other.codes && same(scales, other.scales);
  }
};

inline std::vector<float> squares(std::vector<float> x) {
  for (float& v : x) v *= v;  // second moments are not negative
  return x;
}

}  // namespace ampfuse::kernels::test
