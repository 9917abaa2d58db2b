// The CPU NovoGrad second pass (novograd_apply_span), held against a float64 reference of
// apex's update and, bit for bit, against the scalar float math of novograd_math.h one element
// at a time: the 8-lane loops and the scalar tails must give the same bits, for fp32, fp16 and
// bf16 params and grads, with and without masters and grad write-back; an inf or NaN grad must
// reach its own element and no other. (These run the variant the public span picks: on a CPU
// with F16C, the F16C lanes for fp16/bf16; test_novograd_variants.cpp holds the
// software-converting lanes to the same bits.) The bf16 master-free modes' span
// (novograd_bf16_span) is held to the fp32-master span bit for bit in "split".
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "span_test_values.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

namespace {

// Around the 8-lane vectors: tails of 1 to 7 elements, and none.
const std::int64_t kApplySizes[] = {1, 7, 8, 37, 1000};

// Half a unit in the last place of `Storage` at x, or more: what rounding a float to it adds.
// fp16 keeps 11 significant bits and spaces its subnormals 2^-24 apart; bf16 keeps 8 and has
// float's exponent range.
template <typename Storage>
double rounding_slack(double x) {
  switch (dtype_of<Storage>()) {
    case DType::kFloat16:
      return std::fabs(x) * 0x1p-11 + 0x1p-25;
    case DType::kBFloat16:
      return std::fabs(x) * 0x1p-8;
    default:
      return 0.0;
  }
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
  const NovoGradConfig config{0.95,  0.98, 1e-8, o.weight_decay, true, true, o.reg_inside_moment,
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

// "split" reads the master its param and low half make up and writes it back so: over steps
// of every option (decay reads the param, reg_inside_moment is a template flag of the bf16
// loop), sizes around the fp32-master span's 8 lanes and grad write-back, its masters, moments
// and written grads are the fp32-master span's bit for bit. Stochastic's bits follow the
// element's index, not the span it is stepped in (the op splits params into spans by load).
TEST_CASE("NovoGrad bf16 spans: split equals the fp32-master span; spans do not move bits",
          "[novograd]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const std::int64_t n : kApplySizes) {
    const std::int64_t half = n / 2;
    std::vector<float> master(n), m1(n, 0.0f), m2(n, 0.0f), m3(n, 0.0f), m4(n, 0.0f);
    std::vector<float> grad(n), grad1(n), grad2(n);
    std::vector<std::uint16_t> param1(n), param2(n), low(n, 0), whole(n), parts(n);
    for (std::int64_t i = 0; i < n; ++i) {
      param1[i] = param2[i] = whole[i] = parts[i] = float_to_bf16(dist(rng));
      master[i] = bf16_to_float(param1[i]);
    }
    int t = 0;
    for (const bool reg_inside_moment : {false, true}) {
      for (const double weight_decay : {0.0, 0.01}) {
        for (const bool write_grad : {false, true}) {
          const NovoGradConfig config{
              0.95, 0.98, 1e-8, weight_decay, true, true, reg_inside_moment, false, false};
          const NovoGradStep step =
              make_novograd_constants(config, static_cast<float>(t), 1e-2f, kGradScale);
          const float denom = novograd_denominator(0.5f + 0.1f * static_cast<float>(t), step);
          for (std::int64_t i = 0; i < n; ++i) {
            grad[i] = grad1[i] = grad2[i] = dist(rng) * kGradScale;
          }
          novograd_apply_span(param1.data(), DType::kBFloat16, grad1.data(), DType::kFloat32,
                              write_grad, m1.data(), master.data(), n, step, denom);
          novograd_bf16_span(param2.data(), {MasterMode::kSplit, low.data(), {0u, 0u}, 0},
                             grad2.data(), DType::kFloat32, write_grad, m2.data(), n, step, denom);
          const RoundingKey key = rounding_key(3, static_cast<float>(t), 5);
          novograd_bf16_span(whole.data(), {MasterMode::kStochastic, nullptr, key, 0}, grad.data(),
                             DType::kFloat32, false, m3.data(), n, step, denom);
          novograd_bf16_span(parts.data(), {MasterMode::kStochastic, nullptr, key, 0}, grad.data(),
                             DType::kFloat32, false, m4.data(), half, step, denom);
          novograd_bf16_span(parts.data() + half, {MasterMode::kStochastic, nullptr, key, half},
                             grad.data() + half, DType::kFloat32, false, m4.data() + half, n - half,
                             step, denom);
          ++t;
        }
      }
    }
    Mismatches bits;
    for (std::int64_t i = 0; i < n; ++i) {
      bits.bits("split master", i, Bf16Param<MasterMode::kSplit>::load(param2[i], low[i]),
                master[i]);
      bits.bits("split exp_avg", i, m2[i], m1[i]);
      bits.bits("split grad", i, grad2[i], grad1[i]);
      bits.bits("stochastic param", i, bf16_to_float(parts[i]), bf16_to_float(whole[i]));
      bits.bits("stochastic exp_avg", i, m4[i], m3[i]);
    }
    INFO("n = " << n << "\n" << bits.report());
    CHECK(bits.count() == 0);
  }
}
