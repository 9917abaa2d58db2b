// The CPU Adam and SGD span kernels against a float64 model of the same update.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

namespace {

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Adam/AdamW in double, with the same configuration.
struct AdamModel {
  std::vector<double> p, m, v, vmax;
  void step(const std::vector<float>& g, const AdamConfig& c, double lr, int t) {
    const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(c.beta2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      double grad = c.maximize ? -g[i] : g[i];
      if (c.adam_w_mode) {
        p[i] *= 1 - lr * c.weight_decay;
      } else {
        grad += c.weight_decay * p[i];
      }
      m[i] = c.beta1 * m[i] + (1 - c.beta1) * grad;
      v[i] = c.beta2 * v[i] + (1 - c.beta2) * grad * grad;
      vmax[i] = std::max(vmax[i], v[i]);
      const double second = c.amsgrad ? vmax[i] : v[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(second) / std::sqrt(bc2) + c.eps);
    }
  }
};

}  // namespace

TEST_CASE("adam_span tracks a float64 Adam over 50 steps") {
  const std::size_t n = 1000;
  for (bool adam_w : {false, true}) {
    for (bool amsgrad : {false, true}) {
      const AdamConfig config{0.9, 0.999, 1e-8, 0.05, adam_w, true, amsgrad, false};
      std::vector<float> p = random_floats(n, 1), m(n), v(n), vmax(n);
      AdamModel model{std::vector<double>(p.begin(), p.end()), std::vector<double>(n),
                      std::vector<double>(n), std::vector<double>(n)};
      for (int t = 1; t <= 50; ++t) {
        const auto g = random_floats(n, 100 + t);
        // Gradients arrive scaled by 1024 and are unscaled inside the kernel.
        std::vector<float> scaled(g);
        for (auto& x : scaled) x *= 1024.0f;
        const AdamStep step = make_step_constants(config, float(t - 1), 1e-2f, 1024.0f);
        adam_span(p.data(), DType::kFloat32, scaled.data(), DType::kFloat32, /*write_grad=*/false,
                  m.data(), v.data(), amsgrad ? vmax.data() : nullptr, nullptr, n, step);
        model.step(g, config, double(1e-2f), t);
      }
      INFO("adam_w " << adam_w << " amsgrad " << amsgrad);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(p[i] == Approx(model.p[i]).margin(2e-5));
    }
  }
}

TEST_CASE("adam_span with an fp32 master writes the param rounded from it") {
  const std::size_t n = 300;
  const AdamConfig config{0.9, 0.999, 1e-8, 0.0, true, true, false, false};
  std::vector<float> master = random_floats(n, 2), m(n), v(n);
  std::vector<std::uint16_t> param(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) param[i] = float_to_bf16(master[i]);
  const auto g = random_floats(n, 3);
  for (std::size_t i = 0; i < n; ++i) grad[i] = float_to_fp16(g[i]);
  adam_span(param.data(), DType::kBFloat16, grad.data(), DType::kFloat16, false, m.data(), v.data(),
            nullptr, master.data(), n, make_step_constants(config, 0.0f, 1e-3f, 1.0f));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(param[i] == float_to_bf16(master[i]));
}

TEST_CASE("sgd_span: momentum seeding, dampening, nesterov and decay placement against float64") {
  const std::size_t n = 500;
  for (bool nesterov : {false, true}) {
    for (bool wd_after_momentum : {false, true}) {
      const SgdConfig config{0.9, nesterov ? 0.0 : 0.1, 0.01, nesterov, false, wd_after_momentum};
      std::vector<float> p = random_floats(n, 4), buf(n, 123.0f);  // garbage until seeded
      std::vector<double> mp(p.begin(), p.end()), mbuf(n);
      for (int t = 0; t < 30; ++t) {
        const auto g = random_floats(n, 200 + t);
        sgd_span(p.data(), DType::kFloat32, const_cast<float*>(g.data()), DType::kFloat32, false,
                 buf.data(), nullptr, n, make_step_constants(config, float(t), 0.05f, 1.0f));
        for (std::size_t i = 0; i < n; ++i) {
          const double decay = config.weight_decay * mp[i];
          double d = g[i] + (wd_after_momentum ? 0.0 : decay);
          mbuf[i] = t == 0 ? d : config.momentum * mbuf[i] + (1 - config.dampening) * d;
          d = nesterov ? d + config.momentum * mbuf[i] : mbuf[i];
          mp[i] -= double(0.05f) * (d + (wd_after_momentum ? decay : 0.0));
        }
      }
      INFO("nesterov " << nesterov << " wd_after_momentum " << wd_after_momentum);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(p[i] == Approx(mp[i]).margin(1e-5));
    }
  }
}

TEST_CASE("adam_span and sgd_span write the unscaled grad back in its own dtype when asked") {
  const std::size_t n = 301;    // not a multiple of any vector width
  const float scale = 1000.0f;  // not a power of two: the grad is divided, not multiplied
  const auto values = random_floats(n, 7);
  const AdamConfig adam{0.9, 0.999, 1e-8, 0.0, true, true, false, false};
  const SgdConfig sgd{0.0, 0.0, 0.0, false, false, false};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool write : {false, true}) {
      for (bool use_adam : {false, true}) {
        std::vector<float> g32(n), param(n, 1.0f), m(n), v(n);
        std::vector<std::uint16_t> g16(n);
        for (std::size_t i = 0; i < n; ++i) {
          g32[i] = values[i] * scale;
          g16[i] = dtype == DType::kFloat16 ? float_to_fp16(g32[i]) : float_to_bf16(g32[i]);
        }
        void* grad = dtype == DType::kFloat32 ? static_cast<void*>(g32.data()) : g16.data();
        if (use_adam) {
          adam_span(param.data(), DType::kFloat32, grad, dtype, write, m.data(), v.data(), nullptr,
                    nullptr, n, make_step_constants(adam, 0.0f, 1e-3f, scale));
        } else {
          sgd_span(param.data(), DType::kFloat32, grad, dtype, write, nullptr, nullptr, n,
                   make_step_constants(sgd, 0.0f, 1e-3f, scale));
        }
        for (std::size_t i = 0; i < n; ++i) {
          const float scaled = values[i] * scale;
          if (dtype == DType::kFloat32) {
            REQUIRE(g32[i] == (write ? scaled / scale : scaled));
          } else {
            const auto round = dtype == DType::kFloat16 ? float_to_fp16 : float_to_bf16;
            const auto widen = dtype == DType::kFloat16 ? fp16_to_float : bf16_to_float;
            REQUIRE(g16[i] == (write ? round(widen(round(scaled)) / scale) : round(scaled)));
          }
        }
      }
    }
  }
}
