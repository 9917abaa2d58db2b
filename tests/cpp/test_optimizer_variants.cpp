// The AVX2+F16C Adam and SGD span kernels against the portable ones, bit for bit, over every
// (param, grad) dtype pair and every option that changes the arrays touched or the math.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/half_convert.h"
#include "cpu/optimizer_variants.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Around the 8-lane vectors and the 512-element staging block, none but 8 and 512 multiples of 8.
const std::int64_t kSizes[] = {1, 7, 8, 9, 23, 511, 512, 513, 1031};

// A signaling NaN with a payload: F16C keeps payloads where the software conversions do not,
// so stores must canonicalize NaN for the two to agree.
const float kPayloadNan = __builtin_bit_cast(float, 0xffa0'1234u);

std::uint16_t round_to(DType dtype, float x) {
  if (__builtin_bit_cast(std::uint32_t, x) == __builtin_bit_cast(std::uint32_t, kPayloadNan)) {
    return dtype == DType::kFloat16 ? 0xfd23 : 0xff91;  // payload NaNs of the half types
  }
  return dtype == DType::kFloat16 ? float_to_fp16(x) : float_to_bf16(x);
}

// An array of one dtype as raw bytes, so two copies compare with memcmp.
struct Array {
  DType dtype;
  std::vector<float> single;
  std::vector<std::uint16_t> half;

  Array(DType d, const std::vector<float>& values) : dtype(d) {
    if (d == DType::kFloat32) {
      single = values;
    } else {
      for (float x : values) half.push_back(round_to(d, x));
    }
  }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(single.data()) : half.data(); }
};

// Every bit the same, except that a NaN only has to meet a NaN: where two NaNs meet in one
// operation (a NaN or inf param and a NaN grad, say), which of them propagates depends on the
// operand order the compiler chose for that loop, so NaN sign and payload are not compared.
bool same_bits(std::uint32_t a, std::uint32_t b, bool a_nan, bool b_nan) {
  return a == b || (a_nan && b_nan);
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!same_bits(__builtin_bit_cast(std::uint32_t, a[i]), __builtin_bit_cast(std::uint32_t, b[i]),
                   std::isnan(a[i]), std::isnan(b[i]))) {
      return false;
    }
  }
  return true;
}

bool same(const Array& a, const Array& b) {
  if (!same(a.single, b.single) || a.half.size() != b.half.size()) return false;
  // fp16 and bf16 NaNs both have all exponent bits set and a nonzero mantissa.
  const std::uint16_t exponent = a.dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  const auto is_nan = [&](std::uint16_t h) {
    return (h & exponent) == exponent && (h & ~exponent & 0x7fff) != 0;
  };
  for (std::size_t i = 0; i < a.half.size(); ++i) {
    if (!same_bits(a.half[i], b.half[i], is_nan(a.half[i]), is_nan(b.half[i]))) return false;
  }
  return true;
}

// Values with inf, -inf, nan and payload nan among them (in the grads: a step the op would skip, run
// anyway so the kernels' handling of them is compared), and fp16 overflow and subnormals.
std::vector<float> test_values(std::int64_t n, std::uint32_t seed, bool nonfinite) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  for (std::int64_t i = 5; i < n; i += 97) v[i] *= 1.0e5f;   // beyond fp16's range
  for (std::int64_t i = 11; i < n; i += 89) v[i] *= 1.0e-6f;  // fp16 subnormals
  if (nonfinite) {
    const float specials[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(), kPayloadNan};
    for (std::int64_t i = 0; i < n; i += 13) v[i] = specials[(i / 13) % 4];
    v[n - 1] = std::numeric_limits<float>::quiet_NaN();  // in the tail of every odd size
  }
  return v;
}

// One copy of everything a step touches; two of them, one per implementation, start equal.
struct State {
  Array param, grad;
  std::vector<float> first, second, third, master;  // moments or momentum, the AMSGrad max

  State(DType param_dtype, DType grad_dtype, std::int64_t n, bool nonfinite)
      : param(param_dtype, test_values(n, 1, false)),
        grad(grad_dtype, test_values(n, 2, nonfinite)),
        first(test_values(n, 3, false)),
        second(test_values(n, 4, false)),
        third(test_values(n, 5, false)),
        master(test_values(n, 1, false)) {
    for (auto& x : second) x *= x;  // second moments are not negative
    for (auto& x : third) x *= x;
  }
};

bool same(const State& a, const State& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.first, b.first) &&
         same(a.second, b.second) && same(a.third, b.third) &&
         same(a.master, b.master);
}

template <typename Step>
void compare(const char* what, Step&& step) {
  for (DType param_dtype : kDtypes) {
    for (DType grad_dtype : kDtypes) {
      for (std::int64_t n : kSizes) {
        for (bool nonfinite : {false, true}) {
          for (bool master : {false, true}) {
            for (bool write_grad : {false, true}) {
              State a(param_dtype, grad_dtype, n, nonfinite), b = a;
              INFO(what << ": param " << int(param_dtype) << " grad " << int(grad_dtype)
                        << " n " << n << " nonfinite " << nonfinite << " master " << master
                        << " write_grad " << write_grad);
              // Three steps: each reads what the last wrote (SGD's first step seeds momentum).
              for (int t = 0; t < 3; ++t) {
                step(true, a, master, write_grad, n, t);
                step(false, b, master, write_grad, n, t);
                REQUIRE(same(a, b));
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("AVX2+F16C adam gives the portable kernel's bits") {
  if (!cpu_has_avx2_f16c()) {
    WARN("this CPU has no AVX2+F16C: only the portable kernels run here");
    return;
  }
  for (bool adam_w : {false, true}) {
    for (bool amsgrad : {false, true}) {
      for (bool maximize : {false, true}) {
        // beta1 0.9 and 0.3 take the two lerp formulas.
        const AdamConfig config{adam_w ? 0.9 : 0.3, 0.999, 1e-8, 0.01, adam_w, true, amsgrad,
                                maximize};
        INFO("adam_w " << adam_w << " amsgrad " << amsgrad << " maximize " << maximize);
        compare("adam", [&](bool use_avx2, State& s, bool master, bool write, std::int64_t n,
                            int t) {
          const AdamStep step = make_step_constants(config, float(t), 1e-3f, 1000.0f);
          auto* run = use_avx2 ? avx2::adam : portable::adam;
          run(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write, s.first.data(),
              s.second.data(), amsgrad ? s.third.data() : nullptr,
              master ? s.master.data() : nullptr, n, step);
        });
      }
    }
  }
}

TEST_CASE("AVX2+F16C sgd gives the portable kernel's bits") {
  if (!cpu_has_avx2_f16c()) {
    WARN("this CPU has no AVX2+F16C: only the portable kernels run here");
    return;
  }
  for (bool momentum : {false, true}) {
    for (bool nesterov : {false, true}) {
      for (bool wd_after_momentum : {false, true}) {
        const SgdConfig config{momentum ? 0.9 : 0.0, nesterov ? 0.0 : 0.1, 0.01, nesterov,
                               !nesterov, wd_after_momentum};
        INFO("momentum " << momentum << " nesterov " << nesterov << " wd_after_momentum "
                         << wd_after_momentum);
        compare("sgd", [&](bool use_avx2, State& s, bool master, bool write, std::int64_t n,
                           int t) {
          const SgdStep step = make_step_constants(config, float(t), 1e-3f, 1000.0f);
          auto* run = use_avx2 ? avx2::sgd : portable::sgd;
          run(s.param.data(), s.param.dtype, s.grad.data(), s.grad.dtype, write,
              momentum ? s.first.data() : nullptr, master ? s.master.data() : nullptr, n, step);
        });
      }
    }
  }
}
#endif
