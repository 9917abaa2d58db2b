// The CPU NovoGrad span kernels (novograd_kernels.cpp) and the element math they share with the
// CUDA kernels (novograd_math.h). The per-step constants, the norm blend and the first pass's L2
// reduction are held against float64; the max reduction must be the float reference's bits. The
// second pass is held against a float64 reference of apex's update and, bit for bit, against the
// scalar float math one element at a time: the 8-lane loops, the scalar tails and the F16C or
// software conversions must all give the same bits, for fp32, fp16 and bf16 params and grads,
// with and without masters and grad write-back. (novograd_kernels.cpp keeps its variants
// internal, so on a CPU with F16C the fp16/bf16 lanes tested here are the F16C ones: the
// software-converting lanes run only on a CPU without it.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// A loss scale that is not a power of two, so that unscaling rounds: the kernels divide, as
// torch does, and multiplying by 1 / scale would give other bits.
constexpr float kGradScale = 384.0f;

// Around the 8-lane vectors (tails of 1 to 7 elements) and the 128-element fold of the fp32
// squares into double: spans shorter than, as long as and longer than one fold.
const std::int64_t kNormSizes[] = {1, 7, 8, 37, 127, 128, 129, 1000, 1003};
const std::int64_t kApplySizes[] = {1, 7, 8, 37, 1000};

// How far a float computation of a few roundings may stray from float64, relative to the sum
// of the magnitudes of its terms (so a cancellation does not need a looser bound).
constexpr double kRelative = 1e-6;

std::vector<float> random_floats(std::int64_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

// Values stored in `Storage` and read back: what the kernels see of a low-precision tensor.
template <typename Storage>
std::vector<Storage> stored(const std::vector<float>& x) {
  std::vector<Storage> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = Element<Storage>::store(x[i]);
  return out;
}

template <typename Storage>
DType dtype_of();
template <>
DType dtype_of<float>() { return DType::kFloat32; }
template <>
DType dtype_of<Fp16Bits>() { return DType::kFloat16; }
template <>
DType dtype_of<Bf16Bits>() { return DType::kBFloat16; }

template <typename Storage>
const char* name_of() {
  return dtype_of<Storage>() == DType::kFloat32   ? "fp32"
         : dtype_of<Storage>() == DType::kFloat16 ? "fp16"
                                                  : "bf16";
}

// Half a unit in the last place of `Storage` at x, or more: what rounding a float to it adds.
// fp16 keeps 11 significant bits and spaces its subnormals 2^-24 apart; bf16 keeps 8 and has
// float's exponent range.
template <typename Storage>
double rounding_slack(double x) {
  switch (dtype_of<Storage>()) {
    case DType::kFloat16: return std::fabs(x) * 0x1p-11 + 0x1p-25;
    case DType::kBFloat16: return std::fabs(x) * 0x1p-8;
    default: return 0.0;
  }
}

template <typename Storage>
bool same_bits(const Storage& a, const Storage& b) {
  return std::memcmp(&a, &b, sizeof(Storage)) == 0;
}

template <typename Storage>
bool same_bytes(const std::vector<Storage>& a, const std::vector<Storage>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Storage)) == 0;
}

std::string describe(double x) {
  std::ostringstream out;
  out << std::setprecision(9) << x << " (" << std::hexfloat << x << ")";
  return out.str();
}

// The mismatches of one comparison over a span. A passing span counts one assertion (CHECK
// on count()) instead of one per element; a failing one names the first few elements.
class Mismatches {
 public:
  void bits(const char* what, std::int64_t i, float got, float want) {
    if (!same_bits(got, want)) note(what, i, got, want);
  }
  template <typename Storage>
  void stored_bits(const char* what, std::int64_t i, Storage got, Storage want) {
    if (!same_bits(got, want)) {
      note(what, i, Element<Storage>::load(got), Element<Storage>::load(want));
    }
  }
  void close(const char* what, std::int64_t i, double got, double want, double tolerance) {
    if (!(std::fabs(got - want) <= tolerance)) note(what, i, got, want);
  }
  int count() const { return count_; }
  std::string report() const { return report_.str(); }

 private:
  void note(const char* what, std::int64_t i, double got, double want) {
    if (count_++ < 3) {
      report_ << what << "[" << i << "]: got " << describe(got) << ", want " << describe(want)
              << "\n";
    }
  }
  int count_ = 0;
  std::ostringstream report_;
};

// ---- the first pass: the reductions ------------------------------------------------------

template <typename Grad>
double reference_sum_of_squares(const std::vector<Grad>& grad, float grad_scale) {
  double sum = 0.0;
  for (const Grad& x : grad) {
    const double g = static_cast<double>(Element<Grad>::load(x)) / grad_scale;
    sum += g * g;
  }
  return sum;
}

// The max norm is exact arithmetic on the unscaled floats: the kernel must give these bits.
template <typename Grad>
float reference_max_abs(const std::vector<Grad>& grad, float grad_scale) {
  float running = 0.0f;
  for (const Grad& x : grad) {
    running = std::max(running, std::fabs(Element<Grad>::load(x) / grad_scale));
  }
  return running;
}

template <typename Grad>
void check_norms(std::int64_t n, float grad_scale) {
  INFO(name_of<Grad>() << " grads, n " << n << ", grad_scale " << grad_scale);
  const std::vector<Grad> grad0 = stored<Grad>(random_floats(n, 11, 100.0f));
  std::vector<Grad> grad(grad0);
  const double l2 = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, grad_scale, false);
  // The squares add in fp32 lanes, folded into double every 128 elements: close, not equal.
  CHECK(l2 == Approx(reference_sum_of_squares(grad0, grad_scale)).epsilon(kRelative));
  const double max = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, grad_scale, true);
  CHECK(max == static_cast<double>(reference_max_abs(grad0, grad_scale)));
  CHECK(same_bytes(grad, grad0));  // the first pass only reads the grads
}

// One inf or NaN grad, at the first, a middle or the last element (in the lanes or in the
// tail), must reach both reductions: a NaN the max norm too, which a plain fmax would drop.
template <typename Grad>
void check_nonfinite_norms(std::int64_t n) {
  for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
    for (float bad : {kNan, kInf, -kInf}) {
      INFO(name_of<Grad>() << " grads, n " << n << ", " << bad << " at " << where);
      std::vector<float> values = random_floats(n, 12, 100.0f);
      values[static_cast<std::size_t>(where)] = bad;
      const std::vector<Grad> grad = stored<Grad>(values);
      const double l2 = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, kGradScale, false);
      const double max = novograd_norm_span(grad.data(), dtype_of<Grad>(), n, kGradScale, true);
      if (std::isnan(bad)) {
        CHECK(std::isnan(max));
        CHECK(std::isnan(l2));
      } else {
        CHECK(l2 == std::numeric_limits<double>::infinity());
        CHECK(max == std::numeric_limits<double>::infinity());
      }
    }
  }
}

// ---- the second pass: the update ----------------------------------------------------------

// apex's update of one element in float64, from the kernels' float constants and inputs.
// Besides p and m it gives the sums of the magnitudes of their terms, which bound how far the
// float arithmetic may stray.
struct ReferenceUpdate {
  double p, m;
  double p_size, m_size;
};

ReferenceUpdate reference_update(double p, double g, double m, double denom,
                                 const NovoGradStep& s) {
  const double beta1 = s.beta1, beta3 = s.beta3, bc1 = s.bias_correction1, lr = s.lr;
  const double decay = s.decay;
  ReferenceUpdate r;
  if (s.reg_inside_moment) {
    const double g_normalized = g / denom + decay * p;
    const double g_size = std::fabs(g / denom) + std::fabs(decay * p);
    r.m = beta1 * m + beta3 * g_normalized;
    r.m_size = beta1 * std::fabs(m) + beta3 * g_size;
    r.p = p - lr * r.m / bc1;
    r.p_size = std::fabs(p) + lr * r.m_size / bc1;
  } else {
    r.m = beta1 * m + beta3 * g;
    r.m_size = beta1 * std::fabs(m) + beta3 * std::fabs(g);
    r.p = p - lr * ((r.m / bc1) / denom + decay * p);
    r.p_size = std::fabs(p) + lr * (r.m_size / bc1 / denom + std::fabs(decay * p));
  }
  return r;
}

struct ApplyOptions {
  bool with_master;
  bool write_grad;
  bool reg_inside_moment;
  double weight_decay;
};

NovoGradStep apply_step(const ApplyOptions& o) {
  const NovoGradConfig config{0.95, 0.98, 1e-8, o.weight_decay, true, true, o.reg_inside_moment,
                              false, false};
  // Step 5 (4 taken): the bias corrections are not 1 and the norm is blended, not seeded.
  return make_novograd_constants(config, 4.0f, 1e-2f, kGradScale);
}

// A tensor's arrays before a step. The master holds the params' values, as the op makes it.
template <typename Param, typename Grad>
struct Tensor {
  std::vector<Param> param;
  std::vector<Grad> grad;
  std::vector<float> exp_avg;
  std::vector<float> master;

  Tensor(std::int64_t n, const std::vector<float>& grad_values)
      : param(stored<Param>(random_floats(n, 1))),
        grad(stored<Grad>(grad_values)),
        exp_avg(random_floats(n, 3, 0.1f)),
        master(param.size()) {
    for (std::size_t i = 0; i < param.size(); ++i) master[i] = Element<Param>::load(param[i]);
  }

  std::int64_t size() const { return static_cast<std::int64_t>(param.size()); }

  // novograd_apply_span over elements [first, first + n).
  void apply(std::int64_t first, std::int64_t n, const ApplyOptions& o, const NovoGradStep& step,
             float denom) {
    const auto i = static_cast<std::size_t>(first);
    novograd_apply_span(&param[i], dtype_of<Param>(), &grad[i], dtype_of<Grad>(), o.write_grad,
                        &exp_avg[i], o.with_master ? &master[i] : nullptr, n, step, denom);
  }
  void apply(const ApplyOptions& o, const NovoGradStep& step, float denom) {
    apply(0, size(), o, step, denom);
  }
};

// The denominator a real step gives this tensor: its grads' L2 norm (the first pass) blended
// into an old running norm of about the same size.
template <typename Grad>
float denominator_for(const std::vector<Grad>& grad, const NovoGradStep& step) {
  const double sum_of_squares = novograd_norm_span(
      grad.data(), dtype_of<Grad>(), static_cast<std::int64_t>(grad.size()), kGradScale, false);
  const float old_norm = 0.8f * static_cast<float>(std::sqrt(sum_of_squares)) + 0.01f;
  return novograd_denominator(novograd_blend(old_norm, sum_of_squares, step), step);
}

template <typename Param, typename Grad>
void check_apply(std::int64_t n, const ApplyOptions& o) {
  INFO(name_of<Param>() << " params, " << name_of<Grad>() << " grads, n " << n << ", master "
                        << o.with_master << ", write_grad " << o.write_grad
                        << ", reg_inside_moment " << o.reg_inside_moment << ", weight_decay "
                        << o.weight_decay);
  const NovoGradStep step = apply_step(o);
  const Tensor<Param, Grad> before(n, random_floats(n, 2, 100.0f));
  const float denom = denominator_for(before.grad, step);
  REQUIRE(std::isfinite(denom));
  REQUIRE(denom > 0.0f);

  Tensor<Param, Grad> after(before);
  after.apply(o, step, denom);

  // The scalar float math one element at a time: the kernels' bits exactly.
  Mismatches bits;
  for (std::int64_t k = 0; k < n; ++k) {
    const auto i = static_cast<std::size_t>(k);
    const float g = unscale_grad(Element<Grad>::load(before.grad[i]), kGradScale);
    float p = before.master[i];
    float m = before.exp_avg[i];
    novograd_update(p, g, m, denom, step);
    bits.bits("exp_avg", k, after.exp_avg[i], m);
    if (o.with_master) bits.bits("master", k, after.master[i], p);
    // The param receives the (master's) new value rounded to its dtype.
    bits.stored_bits("param", k, after.param[i], Element<Param>::store(p));
    // With write_grad the grad keeps its unscaled value in its own dtype; else it is untouched.
    const Grad want_grad = o.write_grad ? Element<Grad>::store(g) : before.grad[i];
    bits.stored_bits("grad", k, after.grad[i], want_grad);
  }
  INFO(bits.report());
  CHECK(bits.count() == 0);
  if (!o.with_master) CHECK(same_bytes(after.master, before.master));

  // apex's update in float64: the float arithmetic within a few roundings of it, the param
  // within half a unit of its dtype more.
  Mismatches far;
  for (std::int64_t k = 0; k < n; ++k) {
    const auto i = static_cast<std::size_t>(k);
    const double g = static_cast<double>(Element<Grad>::load(before.grad[i])) / kGradScale;
    const ReferenceUpdate want =
        reference_update(before.master[i], g, before.exp_avg[i], denom, step);
    far.close("exp_avg", k, after.exp_avg[i], want.m, kRelative * want.m_size);
    if (o.with_master) far.close("master", k, after.master[i], want.p, kRelative * want.p_size);
    far.close("param", k, Element<Param>::load(after.param[i]), want.p,
              kRelative * want.p_size + rounding_slack<Param>(want.p));
  }
  INFO(far.report());
  CHECK(far.count() == 0);

  // The same span one element per call, so that every element takes the scalar tail: the
  // 8-lane loop must give the tail's bits.
  Tensor<Param, Grad> one_by_one(before);
  for (std::int64_t k = 0; k < n; ++k) one_by_one.apply(k, 1, o, step, denom);
  CHECK(same_bytes(one_by_one.param, after.param));
  CHECK(same_bytes(one_by_one.grad, after.grad));
  CHECK(same_bytes(one_by_one.exp_avg, after.exp_avg));
  CHECK(same_bytes(one_by_one.master, after.master));
}

// One param dtype with every grad dtype.
template <typename Param>
void check_apply_all_grads(std::int64_t n, const ApplyOptions& o) {
  check_apply<Param, float>(n, o);
  check_apply<Param, Fp16Bits>(n, o);
  check_apply<Param, Bf16Bits>(n, o);
}

// One inf or NaN grad: its element's param goes to NaN, or to the infinity opposite the grad,
// and every other element gets the bits of the step without it. The denominator is held at the
// clean step's, to look at the second pass alone (in a real step the first pass would carry the
// bad grad into the whole tensor's norm, as the reduction tests show).
template <typename Param, typename Grad>
void check_nonfinite_apply(std::int64_t n, const ApplyOptions& o) {
  const NovoGradStep step = apply_step(o);
  const std::vector<float> grad_values = random_floats(n, 2, 100.0f);
  const Tensor<Param, Grad> before(n, grad_values);
  const float denom = denominator_for(before.grad, step);
  Tensor<Param, Grad> clean(before);
  clean.apply(o, step, denom);

  for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
    for (float bad : {kNan, kInf, -kInf}) {
      INFO(name_of<Param>() << " params, " << name_of<Grad>() << " grads, n " << n << ", master "
                            << o.with_master << ", reg_inside_moment " << o.reg_inside_moment
                            << ", " << bad << " at " << where);
      std::vector<float> poisoned_values(grad_values);
      poisoned_values[static_cast<std::size_t>(where)] = bad;
      Tensor<Param, Grad> poisoned(before);
      poisoned.grad = stored<Grad>(poisoned_values);
      poisoned.apply(o, step, denom);

      const auto w = static_cast<std::size_t>(where);
      const float p = Element<Param>::load(poisoned.param[w]);
      if (std::isnan(bad)) {
        CHECK(std::isnan(p));
        CHECK(std::isnan(poisoned.exp_avg[w]));
        if (o.with_master) CHECK(std::isnan(poisoned.master[w]));
      } else {
        CHECK(p == (bad > 0.0f ? -kInf : kInf));
        CHECK(poisoned.exp_avg[w] == bad);
        if (o.with_master) CHECK(poisoned.master[w] == p);
      }

      Mismatches others;
      for (std::int64_t k = 0; k < n; ++k) {
        if (k == where) continue;
        const auto i = static_cast<std::size_t>(k);
        others.stored_bits("param", k, poisoned.param[i], clean.param[i]);
        others.stored_bits("grad", k, poisoned.grad[i], clean.grad[i]);
        others.bits("exp_avg", k, poisoned.exp_avg[i], clean.exp_avg[i]);
        others.bits("master", k, poisoned.master[i], clean.master[i]);
      }
      INFO(others.report());
      CHECK(others.count() == 0);
    }
  }
}

}  // namespace

TEST_CASE("NovoGrad L2 norm span: the unscaled sum of squares, lanes, folds and tails",
          "[novograd]") {
  for (std::int64_t n : kNormSizes) {
    for (float grad_scale : {1.0f, kGradScale}) {
      check_norms<float>(n, grad_scale);
      check_norms<Fp16Bits>(n, grad_scale);
      check_norms<Bf16Bits>(n, grad_scale);
    }
  }
}

TEST_CASE("NovoGrad norm span: an inf or NaN grad anywhere reaches the reductions", "[novograd]") {
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{8}, std::int64_t{37}, std::int64_t{129},
                         std::int64_t{1003}}) {
    check_nonfinite_norms<float>(n);
    check_nonfinite_norms<Fp16Bits>(n);
    check_nonfinite_norms<Bf16Bits>(n);
  }
}

TEST_CASE("NovoGrad constants: bias corrections, beta3 and the seed as apex forms them",
          "[novograd]") {
  NovoGradConfig config{0.95, 0.98, 1e-8, 0.001, true, true, false, false, false};
  // apex hands the kernel float betas and forms the corrections from them in double.
  const double beta1 = 0.95f, beta2 = 0.98f;

  // Step 5 (4 taken).
  NovoGradStep s = make_novograd_constants(config, 4.0f, 0.01f, kGradScale);
  CHECK(s.bias_correction1 == static_cast<float>(1.0 - std::pow(beta1, 5.0)));
  CHECK(s.bias_correction2 == static_cast<float>(std::sqrt(1.0 - std::pow(beta2, 5.0))));
  // The double betas would give other bits here: the float ones must be the ones used.
  CHECK(s.bias_correction1 != static_cast<float>(1.0 - std::pow(0.95, 5.0)));
  CHECK(s.bias_correction2 != static_cast<float>(std::sqrt(1.0 - std::pow(0.98, 5.0))));
  CHECK(s.beta1 == 0.95f);
  CHECK(s.beta2 == 0.98f);
  CHECK(s.beta3 == 1.0f - 0.95f);  // grad_averaging
  CHECK(s.one_minus_beta2 == 1.0f - 0.98f);
  CHECK(s.eps == 1e-8f);
  CHECK(s.decay == 0.001f);
  CHECK(s.decayed);
  CHECK(s.lr == 0.01f);
  CHECK(s.grad_scale == kGradScale);
  CHECK(s.steps_taken == 4.0f);
  CHECK_FALSE(s.seed);  // past the first step the running norm blends
  CHECK_FALSE(s.reg_inside_moment);
  CHECK_FALSE(s.max_norm);

  // The first step (t = 1) seeds the running norm with its own.
  s = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(s.seed);
  CHECK(s.bias_correction1 == static_cast<float>(1.0 - beta1));
  CHECK(s.bias_correction2 == static_cast<float>(std::sqrt(1.0 - beta2)));
  CHECK(s.grad_scale == 1.0f);

  // init_zero: the running norm starts at 0, never seeded.
  config.init_zero = true;
  CHECK_FALSE(make_novograd_constants(config, 0.0f, 0.01f, 1.0f).seed);
  CHECK_FALSE(make_novograd_constants(config, 3.0f, 0.01f, 1.0f).seed);

  // Without grad_averaging the grad enters the moment whole; the flags pass through.
  config.grad_averaging = false;
  config.reg_inside_moment = true;
  config.max_norm = true;
  config.weight_decay = 0.0;
  s = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  CHECK(s.beta3 == 1.0f);
  CHECK(s.reg_inside_moment);
  CHECK(s.max_norm);
  CHECK(s.decay == 0.0f);
  CHECK_FALSE(s.decayed);

  // Without bias correction both corrections are 1, at any step.
  config.bias_correction = false;
  for (float steps_taken : {0.0f, 4.0f, 1000.0f}) {
    s = make_novograd_constants(config, steps_taken, 0.01f, 1.0f);
    CHECK(s.bias_correction1 == 1.0f);
    CHECK(s.bias_correction2 == 1.0f);
  }
}

TEST_CASE("NovoGrad norm blend and denominator against float64", "[novograd]") {
  NovoGradConfig config{0.95, 0.98, 1e-8, 0.0, true, true, false, false, false};
  const double beta2 = 0.98f;
  // (old running norm, this step's sum of squares or max |g|)
  const std::pair<float, double> cases[] = {
      {2.5f, 9.0}, {1e-3f, 4e-6}, {300.0f, 1e5}, {0.0f, 16.0}, {7.0f, 0.0}};

  // L2: the running norm is a norm, so its square blends with the sum of squares.
  const NovoGradStep l2 = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  for (const auto& [avg, reduction] : cases) {
    INFO("L2: avg " << avg << ", sum of squares " << reduction);
    const double want = std::sqrt(beta2 * avg * avg + (1.0 - beta2) * reduction);
    const float blended = novograd_blend(avg, reduction, l2);
    CHECK(blended == Approx(want).epsilon(kRelative));
    const double bc2 = std::sqrt(1.0 - std::pow(double(0.98f), 5.0));
    CHECK(novograd_denominator(blended, l2) == Approx(blended / bc2 + double(1e-8f)).epsilon(1e-6));
  }

  // Max: the running norm and the max |g| blend linearly.
  config.max_norm = true;
  const NovoGradStep max = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  for (const auto& [avg, reduction] : cases) {
    INFO("max: avg " << avg << ", max |g| " << reduction);
    CHECK(novograd_blend(avg, reduction, max) ==
          Approx(beta2 * avg + (1.0 - beta2) * reduction).epsilon(kRelative));
  }

  // The first step seeds the running norm with the step's own, whatever the old value: the
  // blend leaves it there (up to rounding).
  config.max_norm = false;
  const NovoGradStep l2_seed = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  config.max_norm = true;
  const NovoGradStep max_seed = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  REQUIRE(l2_seed.seed);
  REQUIRE(max_seed.seed);
  for (const auto& [avg, reduction] : cases) {
    INFO("seed: avg " << avg << ", reduction " << reduction);
    CHECK(novograd_blend(avg, reduction, l2_seed) == Approx(std::sqrt(reduction)).epsilon(1e-6));
    CHECK(novograd_blend(avg, reduction, max_seed) == Approx(reduction).epsilon(1e-6));
  }

  // init_zero: the first step blends into the 0 it is given.
  config.init_zero = true;
  config.max_norm = false;
  const NovoGradStep l2_zero = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(novograd_blend(0.0f, 16.0, l2_zero) == Approx(std::sqrt((1.0 - beta2) * 16.0)));
  config.max_norm = true;
  const NovoGradStep max_zero = make_novograd_constants(config, 0.0f, 0.01f, 1.0f);
  CHECK(novograd_blend(0.0f, 4.0, max_zero) == Approx((1.0 - beta2) * 4.0));

  // Without bias correction the denominator is the norm plus eps.
  config.bias_correction = false;
  const NovoGradStep plain = make_novograd_constants(config, 4.0f, 0.01f, 1.0f);
  CHECK(novograd_denominator(2.0f, plain) == 2.0f + 1e-8f);

  // A non-finite reduction (a NaN or inf grad) carries into the norm, hence the denominator.
  for (const NovoGradStep& s : {l2, max}) {
    CHECK(std::isnan(novograd_blend(2.5f, std::nan(""), s)));
    CHECK(novograd_blend(2.5f, std::numeric_limits<double>::infinity(), s) == kInf);
  }
}

TEST_CASE("NovoGrad apply span: float64 reference, and the scalar math's bits in lanes and tails",
          "[novograd]") {
  for (std::int64_t n : kApplySizes) {
    for (bool write_grad : {false, true}) {
      for (bool reg_inside_moment : {false, true}) {
        for (double weight_decay : {0.0, 0.01}) {
          ApplyOptions o{false, write_grad, reg_inside_moment, weight_decay};
          check_apply_all_grads<float>(n, o);
          check_apply_all_grads<Fp16Bits>(n, o);
          check_apply_all_grads<Bf16Bits>(n, o);
          o.with_master = true;
          check_apply_all_grads<Fp16Bits>(n, o);
          check_apply_all_grads<Bf16Bits>(n, o);
        }
      }
    }
  }
}

TEST_CASE("NovoGrad apply span: an inf or NaN grad reaches its own param and no other",
          "[novograd]") {
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{37}, std::int64_t{1003}}) {
    for (bool reg_inside_moment : {false, true}) {
      ApplyOptions o{false, true, reg_inside_moment, 0.01};
      check_nonfinite_apply<float, float>(n, o);
      check_nonfinite_apply<Fp16Bits, Fp16Bits>(n, o);
      check_nonfinite_apply<Bf16Bits, Bf16Bits>(n, o);
      o.with_master = true;
      check_nonfinite_apply<Fp16Bits, Fp16Bits>(n, o);
      check_nonfinite_apply<Bf16Bits, Bf16Bits>(n, o);
      check_nonfinite_apply<Bf16Bits, float>(n, o);
    }
  }
}
