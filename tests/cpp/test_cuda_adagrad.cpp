// cuda::adagrad against the CPU Adagrad span (adagrad_span), bit for bit: both run the element
// math of adagrad_math.h and round every operation alike (mul() keeps nvcc from contracting a
// product into an FMA; the CPU build passes -ffp-contract=off), so from the same constants the
// GPU's params, masters, sums and written-back grads are the CPU's, also in the bf16 master
// modes. And a skipped step writes nothing; the step count advances even over an empty list.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "adagrad_math.h"
#include "cpu/cpu_kernels.h"
#include "cuda_kernels.h"
#include "cuda_test_buffers.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

namespace {

// One tensor's param, grad, running sum of squared grads and master. (The slot's first moment
// `m` is not Adagrad's: no list holds it.)
struct AdagradSlot : OptimizerSlot {
  DeviceTensor sum, master;

  // Grads as a 384 loss scale leaves them (not a power of two: the division rounds); sums of
  // about the size of g * g; masters that are not the params' values, so that reading the
  // param in place of the master shows.
  AdagradSlot(DType p, DType g, std::int64_t size, std::int64_t off, std::uint32_t seed)
      : OptimizerSlot(p, g, size, off, seed, /*grad_bound=*/64.0f),
        sum(DType::kFloat32, size + off, seed + 3, 0.0f, 0.05f),
        master(DType::kFloat32, size + off, seed + 4, -1.0f, 1.0f) {}

  // The order of download_slots.
  std::vector<const DeviceTensor*> tensors() const { return {&param, &grad, &sum, &master}; }
};

using Slots = std::vector<std::unique_ptr<AdagradSlot>>;

// A tensor over one 64K chunk and not a multiple of 4 (packs, a scalar tail, several chunks),
// one over a chunk viewed one element in (unaligned: the scalar path), a tiny one and one
// without elements; every param dtype, with grads of its own and of other dtypes. The same
// seeds on every call.
Slots adagrad_slots() {
  Slots slots;
  slots.emplace_back(new AdagradSlot(DType::kFloat32, DType::kFloat16, 3 * 65536 + 5, 0, 10));
  slots.emplace_back(new AdagradSlot(DType::kFloat16, DType::kFloat16, 70001, 0, 20));
  slots.emplace_back(new AdagradSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
  slots.emplace_back(new AdagradSlot(DType::kFloat32, DType::kFloat32, 7, 0, 30));
  slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kFloat32, 65536 + 3, 1, 40));
  slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kBFloat16, 4099, 0, 50));
  slots.emplace_back(new AdagradSlot(DType::kFloat16, DType::kBFloat16, 13, 1, 60));
  return slots;
}

struct AdagradLists {
  std::vector<TensorRef> P, G, S, W;
  AdagradLists(const Slots& slots, bool with_masters) {
    for (const auto& s : slots) {
      P.push_back(s->at(s->param));
      G.push_back(s->at(s->grad));
      S.push_back(s->at(s->sum));
      if (with_masters) W.push_back(s->at(s->master));
    }
  }
};

// Config fields: lr_decay, weight_decay, eps, decoupled, maximize. torch's update with its L2
// decay and an lr decay; apex's adagrad_w_mode, maximizing; no decay at all.
const AdagradConfig kConfigs[] = {{0.01, 0.01, 1e-10, false, false},
                                  {0.0, 0.01, 1e-10, true, true},
                                  {0.0, 0.0, 1e-10, false, false}};

constexpr float kLr = 1e-2f;
constexpr float kLossScale = 384.0f;

// Steps every slot's host bits with the CPU span and requires the GPU's step to match.
void require_matches_cpu(const Slots& slots, bool with_masters, bool write_grads,
                         const AdagradStep& used) {
  for (std::size_t t = 0; t < slots.size(); ++t) {
    AdagradSlot& s = *slots[t];
    std::vector<unsigned char> p = s.param.host, g = s.grad.host, sum = s.sum.host,
                               w = s.master.host;
    const auto fp32 = [&](std::vector<unsigned char>& h) {
      return reinterpret_cast<float*>(s.host_at(h, DType::kFloat32));
    };
    cpu::adagrad_span(s.host_at(p, s.param.dtype), s.param.dtype, s.host_at(g, s.grad.dtype),
                      s.grad.dtype, write_grads, fp32(sum), with_masters ? fp32(w) : nullptr, s.n,
                      used);
    INFO("tensor " << t << " (" << s.n << " elements)");
    REQUIRE(s.param.download() == p);
    REQUIRE(s.grad.download() == g);
    REQUIRE(s.sum.download() == sum);
    REQUIRE(s.master.download() == w);
    // The step did move the sums (each gains g * g).
    if (s.n > 0) REQUIRE(sum != s.sum.host);
  }
}

}  // namespace

TEST_CASE("CUDA Adagrad is bit-identical to the CPU span, and skips on overflow") {
  for (const AdagradConfig& config : kConfigs) {
    for (float steps_taken : {0.0f, 3.0f}) {
      for (bool with_masters : {false, true}) {
        for (bool write_grads : {false, true}) {
          INFO("weight_decay " << config.weight_decay << ", decoupled " << config.decoupled
                               << ", steps taken " << steps_taken << ", masters " << with_masters
                               << ", write_grads " << write_grads);
          const Slots slots = adagrad_slots();
          const AdagradLists lists(slots, with_masters);
          DeviceScalar<AdagradStep> constants(AdagradStep{});
          DeviceScalar<float> step(steps_taken), lr(kLr), scale(kLossScale), found(0.0f);
          const StepScalars scalars{step.device, lr.device, scale.device, found.device};

          cuda::adagrad(lists.P, lists.G, lists.S, lists.W, config, scalars, write_grads,
                        constants.device, nullptr);
          check(cudaDeviceSynchronize());
          REQUIRE(step.get() == steps_taken + 1.0f);

          // The CPU reference runs with the constants the GPU used, so that this test holds
          // the element math to the same bits; clr's own last bit is the test below's.
          const AdagradStep used = constants.get();
          const AdagradStep host = make_step_constants(config, steps_taken, kLr, kLossScale);
          REQUIRE(floats_within_ulps(used.clr, host.clr, 1));
          REQUIRE(used.decay == host.decay);
          REQUIRE(used.eps == host.eps);
          REQUIRE(used.grad_scale == kLossScale);
          REQUIRE(used.l2 == host.l2);
          REQUIRE(used.decoupled == host.decoupled);
          REQUIRE(used.maximize == config.maximize);
          REQUIRE(used.steps_taken == steps_taken);
          require_matches_cpu(slots, with_masters, write_grads, used);

          // A skipped step writes nothing: params, grads, sums, masters and the step count
          // stay as they are.
          const std::vector<std::vector<unsigned char>> before = download_slots(slots);
          found.set(1.0f);
          cuda::adagrad(lists.P, lists.G, lists.S, lists.W, config, scalars, true, constants.device,
                        nullptr);
          check(cudaDeviceSynchronize());
          REQUIRE(step.get() == steps_taken + 1.0f);
          REQUIRE(download_slots(slots) == before);
        }
      }
    }
  }
}

TEST_CASE("CUDA Adagrad over an empty list only advances the step count") {
  DeviceScalar<float> step(7.0f), lr(kLr), found(0.0f);
  DeviceScalar<AdagradStep> constants(AdagradStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const std::vector<TensorRef> none;
  cuda::adagrad(none, none, none, none, kConfigs[0], scalars, false, constants.device, nullptr);
  REQUIRE(step.get() == 8.0f);
  REQUIRE(constants.get().steps_taken == 7.0f);
  REQUIRE(constants.get().grad_scale == 1.0f);  // no loss scale given
  found.set(1.0f);
  cuda::adagrad(none, none, none, none, kConfigs[0], scalars, false, constants.device, nullptr);
  REQUIRE(step.get() == 8.0f);
}

// The bf16 master modes: bf16 params, the mode's extra array (kahan compensations, or split's
// low halves, here any bf16 bit patterns) and, for stochastic, param ids keying the bits. The
// CPU reference is adagrad_bf16_span with the same key per param.
TEST_CASE("CUDA Adagrad's bf16 modes are bit-identical to the CPU spans, and skip on overflow") {
  const std::vector<std::int32_t> ids = {11, 12, 13, 14};
  for (const MasterMode mode : {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit}) {
    INFO("mode " << static_cast<int>(mode));
    const bool stochastic = mode == MasterMode::kStochastic;
    Slots slots;
    slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kFloat16, 3 * 65536 + 5, 0, 10));
    slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kFloat32, 65536 + 3, 1, 20));
    slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kBFloat16, 7, 0, 30));
    slots.emplace_back(new AdagradSlot(DType::kBFloat16, DType::kBFloat16, 0, 0, 40));
    std::vector<std::unique_ptr<DeviceTensor>> extras;
    AdagradLists lists(slots, false);
    for (std::size_t t = 0; t < slots.size(); ++t) {
      extras.emplace_back(new DeviceTensor(DType::kBFloat16, slots[t]->n + slots[t]->offset,
                                           static_cast<std::uint32_t>(50 + t), -1e-3f, 1e-3f));
      if (!stochastic) lists.W.push_back(slots[t]->at(*extras[t]));
    }
    const MasterListMode how{mode, 9, stochastic ? ids : std::vector<std::int32_t>{}};
    DeviceScalar<AdagradStep> constants(AdagradStep{});
    DeviceScalar<float> step(3.0f), lr(kLr), scale(kLossScale), found(0.0f);
    const StepScalars scalars{step.device, lr.device, scale.device, found.device};
    cuda::adagrad(lists.P, lists.G, lists.S, lists.W, kConfigs[0], scalars, true, constants.device,
                  nullptr, how);
    check(cudaDeviceSynchronize());
    const AdagradStep used = constants.get();
    for (std::size_t t = 0; t < slots.size(); ++t) {
      AdagradSlot& s = *slots[t];
      std::vector<unsigned char> p = s.param.host, g = s.grad.host, sum = s.sum.host,
                                 x = extras[t]->host;
      const auto bits = [&](std::vector<unsigned char>& h) {
        return reinterpret_cast<std::uint16_t*>(s.host_at(h, DType::kBFloat16));
      };
      const cpu::Bf16Span span{mode, stochastic ? nullptr : bits(x),
                               stochastic ? rounding_key(9, 3.0f, ids[t]) : RoundingKey{0u, 0u}, 0};
      cpu::adagrad_bf16_span(bits(p), span, s.host_at(g, s.grad.dtype), s.grad.dtype, true,
                             reinterpret_cast<float*>(s.host_at(sum, DType::kFloat32)), s.n, used);
      INFO("tensor " << t);
      REQUIRE(s.param.download() == p);
      REQUIRE(s.grad.download() == g);
      REQUIRE(s.sum.download() == sum);
      REQUIRE(extras[t]->download() == x);
    }
    std::vector<std::vector<unsigned char>> before = download_slots(slots);
    for (const auto& e : extras) before.push_back(e->download());
    found.set(1.0f);
    cuda::adagrad(lists.P, lists.G, lists.S, lists.W, kConfigs[0], scalars, true, constants.device,
                  nullptr, how);
    check(cudaDeviceSynchronize());
    std::vector<std::vector<unsigned char>> after = download_slots(slots);
    for (const auto& e : extras) after.push_back(e->download());
    REQUIRE(after == before);
  }
}

// clr = lr / (1 + steps_taken * lr_decay) in double, rounded once, as torch forms it in Python
// and the CPU op does. For these inputs (found by search), 1 + 36 * 0.01 with the product
// rounded first and as one fused multiply-add give quotients on either side of a float rounding
// boundary: a GPU that contracts the double product into an FMA forms a clr one ulp off.
TEST_CASE("CUDA Adagrad forms clr as the CPU does, without contracting it into an FMA") {
  const float lr = __builtin_bit_cast(float, 0x3ad36241u);  // about 0.0016127
  const AdagradConfig config{0.01, 0.0, 1e-10, false, false};
  const AdagradStep host = make_step_constants(config, 36.0f, lr, 1.0f);
  REQUIRE(host.clr != static_cast<float>(double{lr} / std::fma(36.0, 0.01, 1.0)));

  DeviceScalar<float> step(36.0f), lr_on_device(lr);
  DeviceScalar<AdagradStep> constants(AdagradStep{});
  const StepScalars scalars{step.device, lr_on_device.device, nullptr, nullptr};
  const std::vector<TensorRef> none;
  cuda::adagrad(none, none, none, none, config, scalars, false, constants.device, nullptr);
  REQUIRE(constants.get().clr == host.clr);
}
