// cuda::lamb against the CPU LAMB spans (cpu_kernels.h), run the way the CPU op runs them: the
// moments pass per tensor with its sums of squares in double, the trust ratio from their square
// roots, then the apply pass. The moments and the written-back grads are bit-identical. The
// GPU adds the sums of squares in another order, so its trust ratio may differ from the CPU's
// in the last bits; the CPU's apply then runs with the GPU's ratio, and the params and masters
// are bit-identical too. (Comparing them after each side's own ratio cannot work in ulps of the
// result: where p - ratio * update nearly cancels, a 2-ulp ratio difference moves the param by
// thousands of its own ulps. The first H100 run failed that way: 2048 ulps, at a param of
// -3.3e-7 that started at -3.9e-4.)
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cuda_kernels.h"
#include "cuda_test_buffers.h"
#include "lamb_math.h"
#include "launch_plan.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

namespace {

// One tensor's param, grad, moments and master.
struct LambSlot : OptimizerSlot {
  DeviceTensor v, master;

  LambSlot(DType p, DType g, std::int64_t size, std::int64_t off, std::uint32_t seed)
      : OptimizerSlot(p, g, size, off, seed, /*grad_bound=*/1.0f),
        v(DType::kFloat32, size + off, seed + 3, 0.0f, 0.01f),
        master(DType::kFloat32, size + off, seed + 4, -1.0f, 1.0f) {}

  // The order of download_slots.
  std::vector<const DeviceTensor*> tensors() const { return {&param, &grad, &m, &v, &master}; }
};

// Clipped AdamW-style with bias correction; and unclipped, L2 decay, no bias correction, no
// grad averaging (grad_norm null: read only when clipping).
const LambConfig kConfigs[] = {{0.9, 0.999, 1e-6, 0.01, 1.0, true, true, true, false},
                               {0.9, 0.99, 1e-8, 0.01, 0.0, false, false, false, true}};

// Sizes over 64K and not multiples of 4 (packs and a scalar tail, a tensor over several
// chunks), a tiny one, and an unaligned one; with `empty_shard`, also a tensor without elements
// (no chunk: sums 0, ratio the plain lr; viewed one element into a one-element allocation, so
// every copy of it moves a byte). The same seeds on every call: two calls start from the same
// bits.
std::vector<std::unique_ptr<LambSlot>> lamb_slots(bool empty_shard) {
  std::vector<std::unique_ptr<LambSlot>> slots;
  slots.emplace_back(new LambSlot(DType::kFloat32, DType::kFloat16, 3 * 65536 + 5, 0, 10));
  slots.emplace_back(new LambSlot(DType::kFloat16, DType::kFloat16, 70001, 0, 20));
  if (empty_shard) slots.emplace_back(new LambSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
  slots.emplace_back(new LambSlot(DType::kFloat32, DType::kFloat32, 7, 0, 30));
  slots.emplace_back(new LambSlot(DType::kBFloat16, DType::kFloat32, 65536 + 3, 1, 40));
  return slots;
}

struct LambLists {
  std::vector<TensorRef> P, G, M, V, W;
  LambLists(const std::vector<std::unique_ptr<LambSlot>>& slots, bool with_masters) {
    for (const auto& s : slots) {
      P.push_back(s->at(s->param));
      G.push_back(s->at(s->grad));
      M.push_back(s->at(s->m));
      V.push_back(s->at(s->v));
      if (with_masters) W.push_back(s->at(s->master));
    }
  }
};

// Host copies of one slot's tensors, stepped by the CPU spans the way the CPU op steps them.
struct HostStep {
  LambSlot& slot;
  std::vector<unsigned char> p, g, m, v, w;
  float* master;

  HostStep(LambSlot& s, bool with_masters)
      : slot(s),
        p(s.param.host),
        g(s.grad.host),
        m(s.m.host),
        v(s.v.host),
        w(s.master.host),
        master(with_masters ? reinterpret_cast<float*>(s.host_at(w, DType::kFloat32)) : nullptr) {}

  float* moment(std::vector<unsigned char>& h) {
    return reinterpret_cast<float*>(slot.host_at(h, DType::kFloat32));
  }
  // The first pass; returns the sums of squares of the param and of the update.
  std::pair<double, double> moments(bool write_grads, const LambStep& step) {
    double param_sq = 0.0, update_sq = 0.0;
    cpu::lamb_moments_span(slot.host_at(p, slot.param.dtype), slot.param.dtype,
                           slot.host_at(g, slot.grad.dtype), slot.grad.dtype, write_grads,
                           moment(m), moment(v), master, slot.n, step, &param_sq, &update_sq);
    return {param_sq, update_sq};
  }
  void apply(const LambStep& step, float ratio) {
    cpu::lamb_apply_span(slot.host_at(p, slot.param.dtype), slot.param.dtype, moment(m), moment(v),
                         master, slot.n, step, ratio);
  }
};

}  // namespace

TEST_CASE("CUDA LAMB matches the CPU LAMB spans, and skips on overflow") {
  for (const LambConfig& config : kConfigs) {
    for (bool with_masters : {false, true}) {
      for (bool write_grads : {false, true}) {
        const auto slots = lamb_slots(/*empty_shard=*/false);
        const LambLists lists(slots, with_masters);
        const std::int64_t chunks = cuda::lamb_scratch_chunks(lists.P);
        REQUIRE(chunks == 4 + 2 + 1 + 2);
        DeviceArray<float> chunk_sums(2 * chunks),
            ratios(static_cast<std::int64_t>(lists.P.size()));
        DeviceArray<std::int32_t> chunk_owner(chunks);
        DeviceScalar<LambStep> constants(LambStep{});
        // The global norm of the grads as passed (scaled): 512 * 300 clips to max_grad_norm 1.
        DeviceScalar<float> step(3.0f), lr(1e-3f), scale(512.0f), found(0.0f),
            grad_norm(512.0f * 300.0f);
        const StepScalars scalars{step.device, lr.device, scale.device, found.device};
        const float* norm = config.max_grad_norm > 0.0 ? grad_norm.device : nullptr;

        cuda::lamb(lists.P, lists.G, lists.M, lists.V, lists.W, config, scalars, norm, write_grads,
                   constants.device, chunk_sums.device, chunk_owner.device, ratios.device, nullptr);
        check(cudaDeviceSynchronize());
        REQUIRE(step.get() == 4.0f);

        // The CPU reference runs with the constants the GPU used (each side's double pow may
        // differ in the last bit; compared to within one ulp here).
        const LambStep used = constants.get();
        const LambStep host = make_lamb_constants(
            config, 3.0f, 1e-3f, 512.0f, config.max_grad_norm > 0.0 ? 512.0f * 300.0f : 0.0f);
        REQUIRE(floats_within_ulps(used.bias_correction1, host.bias_correction1, 1));
        REQUIRE(floats_within_ulps(used.bias_correction2, host.bias_correction2, 1));
        REQUIRE(used.clip_divisor == host.clip_divisor);
        REQUIRE(used.clipped == (config.max_grad_norm > 0.0));
        REQUIRE(used.grad_scale == 512.0f);
        REQUIRE(used.steps_taken == 3.0f);

        const std::vector<float> device_ratios = download_array(ratios.device, lists.P.size());
        for (std::size_t t = 0; t < slots.size(); ++t) {
          LambSlot& s = *slots[t];
          HostStep host_step(s, with_masters);
          const auto [param_sq, update_sq] = host_step.moments(write_grads, used);
          const float ratio = lamb_ratio(static_cast<float>(std::sqrt(param_sq)),
                                         static_cast<float>(std::sqrt(update_sq)), used);
          INFO("tensor " << t << ", masters " << with_masters << ", write_grads " << write_grads
                         << ", ratio " << ratio << " (GPU " << device_ratios[t] << ")");
          REQUIRE(floats_within_ulps(device_ratios[t], ratio, 2));
          host_step.apply(used, device_ratios[t]);
          REQUIRE(s.m.download() == host_step.m);
          REQUIRE(s.v.download() == host_step.v);
          REQUIRE(s.grad.download() == host_step.g);
          REQUIRE(s.param.download() == host_step.p);
          REQUIRE(s.master.download() == host_step.w);
          REQUIRE(s.param.download() != s.param.host);  // the step did move the params
        }

        // A skipped step writes nothing but scratch: params, grads, moments, masters and the
        // step count stay as they are.
        const std::vector<std::vector<unsigned char>> before = download_slots(slots);
        found.set(1.0f);
        cuda::lamb(lists.P, lists.G, lists.M, lists.V, lists.W, config, scalars, norm, true,
                   constants.device, chunk_sums.device, chunk_owner.device, ratios.device, nullptr);
        check(cudaDeviceSynchronize());
        REQUIRE(step.get() == 4.0f);
        REQUIRE(download_slots(slots) == before);
      }
    }
  }
}

TEST_CASE("CUDA LAMB over an empty list only advances the step count") {
  DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
  DeviceScalar<LambStep> constants(LambStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const std::vector<TensorRef> none;
  const LambConfig config{0.9, 0.999, 1e-6, 0.01, 0.0, true, true, true, false};
  REQUIRE(cuda::lamb_scratch_chunks(none) == 0);
  cuda::lamb(none, none, none, none, none, config, scalars, nullptr, false, constants.device,
             nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
  found.set(1.0f);
  cuda::lamb(none, none, none, none, none, config, scalars, nullptr, false, constants.device,
             nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
}

TEST_CASE("CUDA LAMB in two halves (moments, then apply) is the one-call step bit for bit") {
  for (const LambConfig& config : kConfigs) {
    for (bool with_masters : {false, true}) {
      for (bool write_grads : {false, true}) {
        INFO("max_grad_norm " << config.max_grad_norm << ", masters " << with_masters
                              << ", write_grads " << write_grads);
        // One set of tensors steps in one call (kBoth, asked for its tensor sums too), the other
        // in two (the sums passed from the first half to the second unchanged: one device, so
        // nothing to add over shards).
        const auto one = lamb_slots(/*empty_shard=*/true);
        const auto two = lamb_slots(/*empty_shard=*/true);
        const LambLists a(one, with_masters), b(two, with_masters);
        const std::size_t n = one.size();
        const std::int64_t chunks = cuda::lamb_scratch_chunks(a.P);
        REQUIRE(chunks == 4 + 2 + 1 + 2);
        DeviceArray<float> chunk_sums(2 * chunks), ratios_a(static_cast<std::int64_t>(n)),
            ratios_b(static_cast<std::int64_t>(n));
        DeviceArray<std::int32_t> chunk_owner(chunks);
        DeviceArray<double> sums_a(2 * static_cast<std::int64_t>(n)),
            sums_b(2 * static_cast<std::int64_t>(n));
        DeviceScalar<LambStep> constants_a(LambStep{}), constants_b(LambStep{});
        DeviceScalar<float> step_a(3.0f), step_b(3.0f), lr(1e-3f), scale(512.0f), found(0.0f),
            grad_norm(512.0f * 300.0f);
        const StepScalars scalars_a{step_a.device, lr.device, scale.device, found.device};
        const StepScalars scalars_b{step_b.device, lr.device, scale.device, found.device};
        const float* norm = config.max_grad_norm > 0.0 ? grad_norm.device : nullptr;

        cuda::lamb(a.P, a.G, a.M, a.V, a.W, config, scalars_a, norm, write_grads,
                   constants_a.device, chunk_sums.device, chunk_owner.device, ratios_a.device,
                   nullptr, LambPart::kBoth, sums_a.device);
        check(cudaDeviceSynchronize());
        REQUIRE(step_a.get() == 4.0f);
        const LambStep used = constants_a.get();

        // The first half: no ratios (null), no param or master written, the count kept.
        cuda::lamb(b.P, b.G, b.M, b.V, b.W, config, scalars_b, norm, write_grads,
                   constants_b.device, chunk_sums.device, chunk_owner.device, nullptr, nullptr,
                   LambPart::kMoments, sums_b.device);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == 3.0f);
        for (std::size_t t = 0; t < n; ++t) {
          INFO("tensor " << t);
          REQUIRE(two[t]->param.download() == two[t]->param.host);
          REQUIRE(two[t]->master.download() == two[t]->master.host);
          REQUIRE(two[t]->m.download() == one[t]->m.download());
          REQUIRE(two[t]->v.download() == one[t]->v.download());
          REQUIRE(two[t]->grad.download() == one[t]->grad.download());
        }
        const std::vector<double> host_sums_a = download_array(sums_a.device, 2 * n);
        REQUIRE(download_array(sums_b.device, 2 * n) == host_sums_a);

        // The second half, as the op runs it: no grad norm (it forms no clip), no grad
        // write-back, no chunk scratch (it reads neither grads nor chunk sums).
        cuda::lamb(b.P, b.G, b.M, b.V, b.W, config, scalars_b, nullptr, false, constants_b.device,
                   nullptr, nullptr, ratios_b.device, nullptr, LambPart::kApply, sums_b.device);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == 4.0f);
        const LambStep used_b = constants_b.get();
        REQUIRE(used_b.steps_taken == used.steps_taken);
        REQUIRE(used_b.bias_correction1 == used.bias_correction1);
        REQUIRE(used_b.bias_correction2 == used.bias_correction2);
        REQUIRE(download_array(ratios_b.device, n) == download_array(ratios_a.device, n));
        REQUIRE(download_slots(two) == download_slots(one));
        REQUIRE(one[0]->param.download() != one[0]->param.host);  // the step did move them

        // kBoth's sums against the CPU's double sums of the first pass (the GPU adds in fp32
        // within a chunk: not bit for bit).
        for (std::size_t t = 0; t < n; ++t) {
          LambSlot& s = *one[t];
          const auto [param_sq, update_sq] = HostStep(s, with_masters).moments(write_grads, used);
          INFO("tensor " << t << ": GPU sums " << host_sums_a[2 * t] << ", "
                         << host_sums_a[2 * t + 1] << "; CPU " << param_sq << ", " << update_sq);
          REQUIRE(std::abs(host_sums_a[2 * t] - param_sq) <= 1e-6 * param_sq);
          REQUIRE(std::abs(host_sums_a[2 * t + 1] - update_sq) <= 1e-6 * update_sq);
          REQUIRE((s.n == 0) == (param_sq == 0.0));
        }

        // Skipped halves write nothing but the constants: no tensor, sum, ratio or count.
        const std::vector<std::vector<unsigned char>> before = download_slots(two);
        const std::vector<float> ratios_before = download_array(ratios_b.device, n);
        found.set(1.0f);
        cuda::lamb(b.P, b.G, b.M, b.V, b.W, config, scalars_b, norm, true, constants_b.device,
                   chunk_sums.device, chunk_owner.device, nullptr, nullptr, LambPart::kMoments,
                   sums_b.device);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == 4.0f);
        REQUIRE(download_slots(two) == before);
        REQUIRE(download_array(sums_b.device, 2 * n) == host_sums_a);
        check(cudaMemset(sums_b.device, 0, sizeof(double) * 2 * n));  // would change ratios
        cuda::lamb(b.P, b.G, b.M, b.V, b.W, config, scalars_b, nullptr, false, constants_b.device,
                   nullptr, nullptr, ratios_b.device, nullptr, LambPart::kApply, sums_b.device);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == 4.0f);
        REQUIRE(download_slots(two) == before);
        REQUIRE(download_array(ratios_b.device, n) == ratios_before);
      }
    }
  }
}

TEST_CASE("CUDA LAMB's halves on a shard without elements: zero sums, and the count advances") {
  // FSDP2 may leave a rank no element of a tensor: its sums (zeros) still join the all-reduce.
  std::vector<std::unique_ptr<LambSlot>> empty;
  empty.emplace_back(new LambSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
  const LambLists l(empty, true);
  REQUIRE(cuda::lamb_scratch_chunks(l.P) == 0);
  DeviceArray<double> sums(2);
  DeviceArray<float> ratio(1);
  check(cudaMemset(sums.device, 0xff, 2 * sizeof(double)));  // NaN bits
  DeviceScalar<LambStep> constants(LambStep{});
  DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const LambConfig config{0.9, 0.999, 1e-6, 0.01, 0.0, true, true, true, false};
  cuda::lamb(l.P, l.G, l.M, l.V, l.W, config, scalars, nullptr, true, constants.device, nullptr,
             nullptr, nullptr, nullptr, LambPart::kMoments, sums.device);
  check(cudaDeviceSynchronize());
  REQUIRE(step.get() == 7.0f);
  REQUIRE(download_array(sums.device, 2) == std::vector<double>{0.0, 0.0});
  cuda::lamb(l.P, l.G, l.M, l.V, l.W, config, scalars, nullptr, false, constants.device, nullptr,
             nullptr, ratio.device, nullptr, LambPart::kApply, sums.device);
  check(cudaDeviceSynchronize());
  REQUIRE(step.get() == 8.0f);
  REQUIRE(download_array(ratio.device, 1) == std::vector<float>{1e-3f});
  REQUIRE(download_slots(empty) == std::vector<std::vector<unsigned char>>{
                                       empty[0]->param.host, empty[0]->grad.host, empty[0]->m.host,
                                       empty[0]->v.host, empty[0]->master.host});
}
