// The master-free bf16 modes on eight lanes (bf16_lanes.h) against their one-element functions
// (bf16_modes.h), for both ways of moving 16-bit words; and the bf16 span kernels: eight-lane
// spans against the same elements run one at a time, and avx2:: against portable::, bit for bit.
#include <catch2/catch.hpp>

// The lanes below are always inlined, so no 32-byte vector is ever passed by the baseline ABI
// that GCC notes under -Wpsabi (the kernels library turns the note off for the same reason).
#pragma GCC diagnostic ignored "-Wpsabi"

#include <cstring>
#include <random>
#include <vector>

#include "bf16_modes.h"
#include "cpu/bf16_variants.h"
#include "cpu/half_convert.h"
#include "cpu/lanes_avx512.h"
#include "variant_test_arrays.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

namespace {

constexpr MasterMode kModes[] = {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit};

// Eight elements through a mode's lanes, from and to arrays (so that no vector crosses a call
// between code built for different instruction sets).
template <MasterMode kMode, typename Words>
AMPFUSE_BF16_INLINE void lanes_round_trip(const float* x, std::uint16_t* param,
                                          std::uint16_t* extra, float* loaded,
                                          const RoundingKey& key, std::uint32_t first_lo) {
  typename Words::Lanes p;
  __builtin_memcpy(&p.v, x, sizeof p.v);
  Bf16ModeLanes<kMode, Words>::store(p, param, extra, 0, key, first_lo);
  const typename Words::Lanes back = Bf16ModeLanes<kMode, Words>::load(param, extra, 0);
  __builtin_memcpy(loaded, &back.v, sizeof back.v);
}

template <MasterMode kMode>
void portable_round_trip(const float* x, std::uint16_t* param, std::uint16_t* extra, float* loaded,
                         const RoundingKey& key, std::uint32_t first_lo) {
  lanes_round_trip<kMode, PortableWords>(x, param, extra, loaded, key, first_lo);
}

#ifdef AMPFUSE_HAVE_AVX2_PATH
template <MasterMode kMode>
AMPFUSE_AVX2 void avx2_round_trip(const float* x, std::uint16_t* param, std::uint16_t* extra,
                                  float* loaded, const RoundingKey& key, std::uint32_t first_lo) {
  lanes_round_trip<kMode, Avx2Words>(x, param, extra, loaded, key, first_lo);
}

template <MasterMode kMode>
AMPFUSE_AVX512_TARGET void avx512_round_trip(const float* x, std::uint16_t* param,
                                             std::uint16_t* extra, float* loaded,
                                             const RoundingKey& key, std::uint32_t first_lo) {
  lanes_round_trip<kMode, avx512::Avx512Words>(x, param, extra, loaded, key, first_lo);
}
#endif

// kWidth: the lanes round_trip moves at once (8, or 16 for AVX-512's).
template <MasterMode kMode, int kWidth = 8, typename RoundTrip>
void compare_with_scalar(RoundTrip&& round_trip) {
  // Every high half with the low halves where rounding turns and a random one: infinities, the
  // values that round to them, NaNs, zeros and subnormals, in groups of eight.
  std::mt19937 rng(13);
  std::vector<float> x;
  for (std::uint32_t high = 0; high < 0x10000u; ++high) {
    for (const std::uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                                    static_cast<std::uint32_t>(rng() & 0xffffu), 0x4000u}) {
      x.push_back(bits_to_float((high << 16) | low));
    }
  }
  const RoundingKey key = chunk_key(rounding_key(3, 4.0f, 5), 0);
  for (std::size_t start = 0; start < x.size(); start += kWidth) {
    const auto first_lo = static_cast<std::uint32_t>(start * 977u);  // wraps past 2^32
    std::uint16_t param[kWidth], extra[kWidth] = {}, want_param[kWidth], want_extra[kWidth] = {};
    float loaded[kWidth];
    round_trip(&x[start], param, extra, loaded, key, first_lo);
    for (int k = 0; k < kWidth; ++k) {
      const std::uint32_t random16 =
          kMode == MasterMode::kStochastic ? rounding_bits(key, first_lo + k) : 0u;
      Bf16Param<kMode>::store(x[start + k], want_param[k], want_extra[k], random16);
      INFO("mode " << int(kMode) << " bits " << float_to_bits(x[start + k]));
      REQUIRE(param[k] == want_param[k]);
      if (kMode != MasterMode::kStochastic) REQUIRE(extra[k] == want_extra[k]);
      const float want = Bf16Param<kMode>::load(want_param[k], want_extra[k]);
      REQUIRE(float_to_bits(loaded[k]) == float_to_bits(want));
    }
  }
}

// The arrays of one bf16 span: a param in `mode` and its extra words, a grad and three fp32
// state arrays (moments, a sum or a momentum buffer).
struct State {
  std::vector<std::uint16_t> param, extra;
  Array grad;
  std::vector<float> first, second, third;

  State(MasterMode mode, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(static_cast<std::size_t>(n)),
        extra(static_cast<std::size_t>(n)),
        grad(grad_dtype, test_values(n, 2, nonfinite)),
        first(test_values(n, 3, false)),
        second(test_values(n, 4, false)),
        third(test_values(n, 5, false)) {
    const std::vector<float> values = test_values(n, 1, nonfinite);
    for (std::size_t i = 0; i < param.size(); ++i) {
      // A split master, or for kahan a small compensation (kStochastic reads no extra words).
      Bf16Param<MasterMode::kSplit>::store(values[i], param[i], extra[i], 0);
      if (mode == MasterMode::kKahan) extra[i] = static_cast<std::uint16_t>(0x3a00u + i % 256u);
    }
    for (auto& s : second) s *= s;  // second moments and sums are not negative
    for (auto& s : third) s *= s;
  }
};

// The value each param holds in `mode` (the extra words unused in kStochastic), compared as
// variant_test_arrays.h compares floats: NaN payloads aside, as the operand order of each loop
// decides which NaN propagates.
bool same_state(MasterMode mode, const State& a, const State& b) {
  for (std::size_t i = 0; i < a.param.size(); ++i) {
    if (mode == MasterMode::kSplit) {
      if (!same(join_master(a.param[i], a.extra[i]), join_master(b.param[i], b.extra[i]))) {
        return false;
      }
    } else if (!same(widen_bf16(a.param[i]), widen_bf16(b.param[i])) ||
               (mode == MasterMode::kKahan &&
                !same(widen_bf16(a.extra[i]), widen_bf16(b.extra[i])))) {
      return false;
    }
  }
  return same(a.grad, b.grad) && same(a.first, b.first) && same(a.second, b.second) &&
         same(a.third, b.third);
}

// One step of every optimizer's bf16 span on `s` (elements [begin, end) of it), through the
// given implementation's entry points.
struct Run {
  MasterMode mode;
  bool write_grad;
  int option;  // 0..3: amsgrad / momentum / decoupled / reg_inside_moment and maximize pairs
  int t;

  template <typename Adam, typename Sgd, typename Adagrad, typename NovoGrad>
  void operator()(State& s, std::int64_t begin, std::int64_t end, Adam adam, Sgd sgd,
                  Adagrad adagrad, NovoGrad novograd) const {
    const bool flag = option & 1, maximize = option & 2;
    const Bf16Span span{mode, s.extra.data() + begin, chunk_key(rounding_key(7, float(t), 2), 0),
                        begin};
    void* grad =
        static_cast<char*>(s.grad.data()) + begin * (s.grad.dtype == DType::kFloat32 ? 4 : 2);
    const std::int64_t n = end - begin;
    std::uint16_t* param = s.param.data() + begin;
    const AdamConfig adam_config{flag ? 0.9 : 0.3, 0.999, 1e-8, 0.01, !flag, true, flag, maximize};
    adam(param, span, grad, s.grad.dtype, write_grad, s.first.data() + begin,
         s.second.data() + begin, s.third.data() + begin, n,
         make_step_constants(adam_config, float(t), 1e-3f, 1000.0f));
    const SgdConfig sgd_config{0.9, 0.1, 0.01, flag, maximize, !flag};
    sgd(param, span, grad, s.grad.dtype, false, flag ? s.first.data() + begin : nullptr, n,
        make_step_constants(sgd_config, float(t), 1e-2f, 1.0f));
    const AdagradConfig adagrad_config{0.01, 0.01, 1e-10, flag, maximize};
    adagrad(param, span, grad, s.grad.dtype, false, s.second.data() + begin, n,
            make_step_constants(adagrad_config, float(t), 1e-2f, 1.0f));
    const NovoGradConfig novograd_config{0.95, 0.98, 1e-8, 0.01, true, true, flag, false, false};
    novograd(param, span, grad, s.grad.dtype, false, s.third.data() + begin, n,
             make_novograd_constants(novograd_config, float(t), 1e-2f, 1.0f), 0.75f);
  }
};

}  // namespace

TEST_CASE("bf16 mode lanes give each element's one-element bits") {
  compare_with_scalar<MasterMode::kStochastic>(portable_round_trip<MasterMode::kStochastic>);
  compare_with_scalar<MasterMode::kKahan>(portable_round_trip<MasterMode::kKahan>);
  compare_with_scalar<MasterMode::kSplit>(portable_round_trip<MasterMode::kSplit>);
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (!cpu_runs_avx2_kernels()) return;
  compare_with_scalar<MasterMode::kStochastic>(avx2_round_trip<MasterMode::kStochastic>);
  compare_with_scalar<MasterMode::kKahan>(avx2_round_trip<MasterMode::kKahan>);
  compare_with_scalar<MasterMode::kSplit>(avx2_round_trip<MasterMode::kSplit>);
  if (!cpu_has_avx512()) return;
  compare_with_scalar<MasterMode::kStochastic, 16>(avx512_round_trip<MasterMode::kStochastic>);
  compare_with_scalar<MasterMode::kKahan, 16>(avx512_round_trip<MasterMode::kKahan>);
  compare_with_scalar<MasterMode::kSplit, 16>(avx512_round_trip<MasterMode::kSplit>);
#endif
}

TEST_CASE("bf16 span kernels: lanes equal one element at a time; AVX2 equals portable") {
  const std::int64_t sizes[] = {7, 8, 9, 23, 513, 1031};
  for (MasterMode mode : kModes) {
    for (DType grad_dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (std::int64_t n : sizes) {
        for (bool nonfinite : {false, true}) {
          for (int option = 0; option < 4; ++option) {
            for (bool write_grad : {false, true}) {
              INFO("mode " << int(mode) << " grad " << int(grad_dtype) << " n " << n
                           << " nonfinite " << nonfinite << " option " << option << " write_grad "
                           << write_grad);
              State lanes(mode, grad_dtype, n, nonfinite), single = lanes;
#ifdef AMPFUSE_HAVE_AVX2_PATH
              State avx2_lanes = lanes, avx512_lanes = lanes;
#endif
              for (int t = 0; t < 3; ++t) {
                const Run run{mode, write_grad, option, t};
                run(lanes, 0, n, portable::adam_bf16, portable::sgd_bf16, portable::adagrad_bf16,
                    portable::novograd_bf16);
                // A one-element span runs the scalar tail only.
                for (std::int64_t i = 0; i < n; ++i) {
                  run(single, i, i + 1, portable::adam_bf16, portable::sgd_bf16,
                      portable::adagrad_bf16, portable::novograd_bf16);
                }
                REQUIRE(same_state(mode, lanes, single));
#ifdef AMPFUSE_HAVE_AVX2_PATH
                if (cpu_runs_avx2_kernels()) {
                  run(avx2_lanes, 0, n, avx2::adam_bf16, avx2::sgd_bf16, avx2::adagrad_bf16,
                      avx2::novograd_bf16);
                  REQUIRE(same_state(mode, lanes, avx2_lanes));
                }
                if (cpu_has_avx512()) {  // Adam's sixteen-lane loop, the others' eight-lane ones
                  run(avx512_lanes, 0, n, avx512::adam_bf16, avx2::sgd_bf16, avx2::adagrad_bf16,
                      avx2::novograd_bf16);
                  REQUIRE(same_state(mode, lanes, avx512_lanes));
                }
#endif
              }
            }
          }
        }
      }
    }
  }
}
