// The span loops of coded_moments.h: encode_block / decode_block of state_codes.h over each
// block of the span, the code picked once per span.
#include "coded_moments.h"

#include <algorithm>
#include <type_traits>

namespace ampfuse::kernels::cpu {
namespace {

template <typename F>
void with_code(StateCode code, bool second, F&& f) {
  const auto pick = [&](auto code_constant) {
    if (second) {
      f(code_constant, std::true_type{});
    } else {
      f(code_constant, std::false_type{});
    }
  };
  if (code == StateCode::kFp8) {
    pick(std::integral_constant<StateCode, StateCode::kFp8>{});
  } else {
    pick(std::integral_constant<StateCode, StateCode::kInt8>{});
  }
}

}  // namespace

void decode_moment_span(const std::uint8_t* codes, const float* scales, std::int64_t first,
                        std::int64_t n, StateCode code, bool second, float* moment) {
  with_code(code, second, [&](auto c, auto s) {
    for (std::int64_t i = 0; i < n; i += kStateBlock) {
      const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - i));
      decode_block<decltype(c)::value, decltype(s)::value>(
          codes + first + i, size, scales[(first + i) / kStateBlock], moment + i);
    }
  });
}

void encode_moment_span(const float* moment, std::int64_t first, std::int64_t n, StateCode code,
                        bool second, std::uint8_t* codes, float* scales) {
  with_code(code, second, [&](auto c, auto s) {
    for (std::int64_t i = 0; i < n; i += kStateBlock) {
      const int size = static_cast<int>(std::min<std::int64_t>(kStateBlock, n - i));
      encode_block<decltype(c)::value, decltype(s)::value>(
          moment + i, size, codes + first + i, &scales[(first + i) / kStateBlock]);
    }
  });
}

}  // namespace ampfuse::kernels::cpu
