// The CPU Adagrad span (adagrad_span) held against a float64 reference of torch.optim.Adagrad's
// update and of apex's decoupled one (adagrad_w_mode), and, bit for bit, against the scalar
// float math of adagrad_math.h one element at a time: the 8-lane loops and the scalar tails must
// give the same bits, for fp32, fp16 and bf16 params and grads, with and without masters and grad
// write-back; an inf or NaN grad must reach its own element and no other. And the per-step
// constants. (These run the variant the public span picks: on a CPU with F16C, the F16C lanes
// for fp16/bf16; test_optimizer_variants.cpp holds the software-converting lanes to the same
// bits.)
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "adagrad_math.h"
#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "span_test_values.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;
using namespace ampfuse::kernels::test;

namespace {

constexpr float kLr = 1e-2f;

// Around the 8-lane vectors: tails of 1 to 7 elements, and none.
const std::int64_t kSpanSizes[] = {1, 7, 8, 37, 1000};

// A config and the steps taken before the step. The first step starts from zero sums, as
// torch's default initial_accumulator_value leaves them; later ones from sums of about the size
// of a step's g * g.
struct Case {
  AdagradConfig config;  // lr_decay, weight_decay, eps, decoupled, maximize
  float steps_taken;
  const char* name;
};

const Case kCases[] = {
    {{0.01, 0.01, 1e-10, false, false}, 4.0f, "torch: L2 decay, lr decay"},
    {{0.0, 0.0, 1e-10, false, true}, 0.0f, "torch: maximize, no decay, first step"},
    {{0.0, 0.01, 1e-10, true, false}, 4.0f, "apex: adagrad_w_mode"},
    {{0.1, 0.05, 1e-8, true, true}, 2.0f, "decoupled decay, maximize, lr decay"},
};

struct Options {
  bool with_master;
  bool write_grad;
};

AdagradStep step_of(const Case& c) {
  return make_step_constants(c.config, c.steps_taken, kLr, kGradScale);
}

// A tensor's arrays before a step. The param is the master rounded, as the op makes it, so a
// kernel that read the param where it should read the master would give other bits.
template <typename Param, typename Grad>
struct Tensor {
  std::vector<float> master;
  std::vector<Param> param;
  std::vector<Grad> grad;
  std::vector<float> sum;

  Tensor(std::int64_t n, const std::vector<float>& grad_values, bool first_step)
      : master(random_floats(n, 1)),
        param(stored<Param>(master)),
        grad(stored<Grad>(grad_values)),
        sum(random_floats(n, 3, 0.5f)) {
    for (auto& s : sum) s = first_step ? 0.0f : s * s;
  }

  std::int64_t size() const { return static_cast<std::int64_t>(param.size()); }

  // adagrad_span over elements [first, first + n).
  void apply(std::int64_t first, std::int64_t n, const Options& o, const AdagradStep& step) {
    const auto i = static_cast<std::size_t>(first);
    adagrad_span(&param[i], dtype_of<Param>(), &grad[i], dtype_of<Grad>(), o.write_grad, &sum[i],
                 o.with_master ? &master[i] : nullptr, n, step);
  }
  void apply(const Options& o, const AdagradStep& step) { apply(0, size(), o, step); }

  // The fp32 value the update starts from: the master's, or the param's own.
  float start(std::size_t i, const Options& o) const {
    return o.with_master ? master[i] : Element<Param>::load(param[i]);
  }
};

template <typename Param, typename Grad>
bool same_tensors(const Tensor<Param, Grad>& a, const Tensor<Param, Grad>& b) {
  return same_bytes(a.master, b.master) && same_bytes(a.param, b.param) &&
         same_bytes(a.grad, b.grad) && same_bytes(a.sum, b.sum);
}

// The step of the scalar float math one element at a time: what the span must give bit for bit.
// `p` receives each element's fp32 result before the param's rounding.
template <typename Param, typename Grad>
Tensor<Param, Grad> scalar_step(const Tensor<Param, Grad>& before, const Options& o,
                                const AdagradStep& step, std::vector<float>& p) {
  Tensor<Param, Grad> after(before);
  p.resize(before.param.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float g = unscale_grad(Element<Grad>::load(before.grad[i]), step.grad_scale);
    p[i] = before.start(i, o);
    adagrad_update(p[i], g, after.sum[i], step);
    if (o.with_master) after.master[i] = p[i];
    after.param[i] = Element<Param>::store(p[i]);
    // With write_grad the grad keeps its unscaled value in its own dtype; else it is untouched.
    if (o.write_grad) after.grad[i] = Element<Grad>::store(g);
  }
  return after;
}

// One element's update in float64, from the config and lr rather than the kernels' float
// constants: torch.optim.Adagrad's (L2 decay joins the grad), or apex's adagrad_w_mode (the
// decay joins the step). With the sums of the magnitudes of the terms of p and of sum, which
// bound how far a float computation may stray (a cancellation needs no looser bound).
struct Reference {
  double p, sum;
  double p_size, sum_size;
};

Reference reference_update(double p, double g, double sum, const Case& c) {
  const AdagradConfig& k = c.config;
  const double clr = static_cast<double>(kLr) / (1.0 + c.steps_taken * k.lr_decay);
  if (k.maximize) g = -g;
  double g_size = std::fabs(g);
  if (!k.decoupled) {
    g += k.weight_decay * p;
    g_size += std::fabs(k.weight_decay * p);
  }
  Reference r;
  r.sum = sum + g * g;
  r.sum_size = sum + g_size * g_size;
  const double std_dev = std::sqrt(r.sum) + k.eps;
  if (k.decoupled) {
    r.p = p - clr * (g / std_dev + k.weight_decay * p);
    r.p_size = std::fabs(p) + clr * (g_size / std_dev + std::fabs(k.weight_decay * p));
  } else {
    r.p = p + (-clr * g) / std_dev;
    r.p_size = std::fabs(p) + clr * g_size / std_dev;
  }
  return r;
}

template <typename Param, typename Grad>
void check_step(std::int64_t n, const Case& c, const Options& o) {
  INFO(c.name << ": " << name_of<Param>() << " params, " << name_of<Grad>() << " grads, n " << n
              << ", master " << o.with_master << ", write_grad " << o.write_grad);
  const AdagradStep step = step_of(c);
  const Tensor<Param, Grad> before(n, random_floats(n, 2, 100.0f), c.steps_taken == 0.0f);
  Tensor<Param, Grad> after(before);
  after.apply(o, step);

  std::vector<float> p;
  const Tensor<Param, Grad> want = scalar_step(before, o, step, p);
  CHECK(same_bytes(after.param, want.param));
  CHECK(same_bytes(after.grad, want.grad));
  CHECK(same_bytes(after.sum, want.sum));
  // Without a master, the master array is not touched.
  CHECK(same_bytes(after.master, want.master));

  // torch's (or apex's) update in float64: the float arithmetic within a few roundings of it.
  // `p` is the span's master, or its param before rounding (the bits just compared).
  for (std::int64_t k = 0; k < n; ++k) {
    const auto i = static_cast<std::size_t>(k);
    const double g = static_cast<double>(Element<Grad>::load(before.grad[i])) / kGradScale;
    const Reference r = reference_update(before.start(i, o), g, before.sum[i], c);
    INFO("element " << k);
    REQUIRE(p[i] == Approx(r.p).epsilon(0.0).margin(kRelative * r.p_size));
    REQUIRE(after.sum[i] == Approx(r.sum).epsilon(0.0).margin(kRelative * r.sum_size));
  }

  // The same span one element per call, so that every element takes the scalar tail: the
  // 8-lane loop must give the tail's bits.
  Tensor<Param, Grad> one_by_one(before);
  for (std::int64_t k = 0; k < n; ++k) one_by_one.apply(k, 1, o, step);
  CHECK(same_tensors(one_by_one, after));
}

// One param dtype with every grad dtype.
template <typename Param>
void check_step_all_grads(std::int64_t n, const Case& c, const Options& o) {
  check_step<Param, float>(n, c, o);
  check_step<Param, Fp16Bits>(n, c, o);
  check_step<Param, Bf16Bits>(n, c, o);
}

// One inf or NaN grad: its element's sum goes to inf (g * g) or NaN, and its param to NaN (the
// step is inf / inf, or NaN); every other element gets the bits of the step without it.
template <typename Param, typename Grad>
void check_nonfinite_step(std::int64_t n, const Case& c, const Options& o) {
  const AdagradStep step = step_of(c);
  const std::vector<float> grad_values = random_floats(n, 2, 100.0f);
  const Tensor<Param, Grad> before(n, grad_values, c.steps_taken == 0.0f);
  Tensor<Param, Grad> clean(before);
  clean.apply(o, step);

  for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
    for (float bad : {kNan, kInf, -kInf}) {
      INFO(c.name << ": " << name_of<Param>() << " params, " << name_of<Grad>() << " grads, n " << n
                  << ", master " << o.with_master << ", " << bad << " at " << where);
      std::vector<float> poisoned_values(grad_values);
      const auto w = static_cast<std::size_t>(where);
      poisoned_values[w] = bad;
      Tensor<Param, Grad> poisoned(before);
      poisoned.grad = stored<Grad>(poisoned_values);
      poisoned.apply(o, step);

      CHECK(std::isnan(Element<Param>::load(poisoned.param[w])));
      if (o.with_master) CHECK(std::isnan(poisoned.master[w]));
      if (std::isnan(bad)) {
        CHECK(std::isnan(poisoned.sum[w]));
      } else {
        CHECK(poisoned.sum[w] == kInf);
      }
      if (o.write_grad) {
        const float g = Element<Grad>::load(poisoned.grad[w]);
        CHECK((std::isnan(bad) ? std::isnan(g) : g == bad));
      }

      // Given the clean step's bits at `where`, the poisoned step's arrays are the clean ones.
      poisoned.master[w] = clean.master[w];
      poisoned.param[w] = clean.param[w];
      poisoned.grad[w] = clean.grad[w];
      poisoned.sum[w] = clean.sum[w];
      CHECK(same_tensors(poisoned, clean));
    }
  }
}

}  // namespace

TEST_CASE("Adagrad constants: clr formed in double and rounded once, the decay's place",
          "[adagrad]") {
  // clr = lr / (1 + steps_taken * lr_decay) as torch forms it in Python: in double, rounded to
  // float once. Float arithmetic gives other bits for some steps, so this tells the two apart.
  const AdagradConfig decaying{1e-3, 0.0, 1e-10, false, false};
  int float_math_differs = 0;
  for (int t = 0; t < 2000; ++t) {
    const float clr = make_step_constants(decaying, float(t), kLr, 1.0f).clr;
    INFO("steps taken " << t);
    REQUIRE(clr == static_cast<float>(static_cast<double>(kLr) / (1.0 + t * 1e-3)));
    if (clr != kLr / (1.0f + float(t) * 1e-3f)) ++float_math_differs;
  }
  CHECK(float_math_differs > 0);
  // Exact cases: the first step, no lr decay, and a power-of-two divisor.
  CHECK(make_step_constants(decaying, 0.0f, kLr, 1.0f).clr == kLr);
  const AdagradConfig constant_lr{0.0, 0.0, 1e-10, false, false};
  CHECK(make_step_constants(constant_lr, 9.0f, kLr, 1.0f).clr == kLr);
  const AdagradConfig unit_lr_decay{1.0, 0.0, 1e-10, false, false};
  CHECK(make_step_constants(unit_lr_decay, 3.0f, kLr, 1.0f).clr == kLr * 0.25f);

  // The decay joins the grad (torch; apex's default mode) or the step (adagrad_w_mode), and
  // neither when it is 0: then both modes run torch's update.
  for (double weight_decay : {0.0, 0.01}) {
    for (bool decoupled : {false, true}) {
      for (bool maximize : {false, true}) {
        const AdagradConfig config{0.5, weight_decay, 1e-10, decoupled, maximize};
        const AdagradStep s = make_step_constants(config, 5.0f, 0.1f, kGradScale);
        INFO("weight_decay " << weight_decay << ", decoupled " << decoupled << ", maximize "
                             << maximize);
        CHECK(s.l2 == (weight_decay != 0.0 && !decoupled));
        CHECK(s.decoupled == (weight_decay != 0.0 && decoupled));
        CHECK(s.decay == static_cast<float>(weight_decay));
        CHECK(s.eps == 1e-10f);
        CHECK(s.maximize == maximize);
        CHECK(s.grad_scale == kGradScale);
        CHECK(s.steps_taken == 5.0f);
        CHECK(s.clr == static_cast<float>(static_cast<double>(0.1f) / 3.5));
      }
    }
  }
}

TEST_CASE(
    "Adagrad span: float64 torch and apex references, and the scalar math's bits in "
    "lanes and tails",
    "[adagrad]") {
  for (const Case& c : kCases) {
    for (std::int64_t n : kSpanSizes) {
      for (bool with_master : {false, true}) {
        for (bool write_grad : {false, true}) {
          const Options o{with_master, write_grad};
          check_step_all_grads<float>(n, c, o);
          check_step_all_grads<Fp16Bits>(n, c, o);
          check_step_all_grads<Bf16Bits>(n, c, o);
        }
      }
    }
  }
}

TEST_CASE("Adagrad span: an inf or NaN grad reaches its own param and no other", "[adagrad]") {
  for (const Case& c : kCases) {
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{37}, std::int64_t{1003}}) {
      Options o{false, true};
      check_nonfinite_step<float, float>(n, c, o);
      check_nonfinite_step<Fp16Bits, Fp16Bits>(n, c, o);
      check_nonfinite_step<Bf16Bits, Bf16Bits>(n, c, o);
      o.with_master = true;
      check_nonfinite_step<Fp16Bits, Fp16Bits>(n, c, o);
      check_nonfinite_step<Bf16Bits, Bf16Bits>(n, c, o);
      check_nonfinite_step<Bf16Bits, float>(n, c, o);
      o.write_grad = false;
      check_nonfinite_step<Fp16Bits, float>(n, c, o);
    }
  }
}
