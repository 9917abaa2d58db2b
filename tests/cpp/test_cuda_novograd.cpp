// cuda::novograd's step against the CPU NovoGrad spans (see cuda_novograd_slots.h for how they
// are compared): in one call, in two halves (the norms, then the apply) as FSDP2 runs it, and in
// the bf16 master modes.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_novograd_slots.h"
#include "cuda_test_buffers.h"
#include "launch_plan.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

TEST_CASE("CUDA NovoGrad matches the CPU NovoGrad spans, and skips on overflow") {
  for_each_novograd_case(
      [](const NovoGradConfig& config, float steps_taken, bool with_masters, bool write_grads) {
        const Slots slots = novograd_slots(config.init_zero && steps_taken == 0.0f);
        const NovoGradLists lists(slots, with_masters);
        const std::size_t n = slots.size();
        const std::int64_t chunks = cuda::novograd_scratch_chunks(lists.P);
        REQUIRE(chunks == kSlotChunks);
        DeviceArray<float> chunk_partials(chunks);
        DeviceArray<std::int32_t> chunk_owner(chunks);
        DeviceArray<double> reductions(static_cast<std::int64_t>(n));
        DeviceScalar<NovoGradStep> constants(NovoGradStep{});
        DeviceScalar<float> step(steps_taken), lr(kLr), scale(kLossScale), found(0.0f);
        const StepScalars scalars{step.device, lr.device, scale.device, found.device};

        cuda::novograd(lists.P, lists.G, lists.M, lists.A, lists.W, config, scalars, write_grads,
                       constants.device, chunk_partials.device, chunk_owner.device,
                       reductions.device, nullptr);
        check(cudaDeviceSynchronize());
        REQUIRE(step.get() == steps_taken + 1.0f);

        // The CPU reference runs with the constants the GPU used (each side's double pow
        // may differ in the last bit; compared to within one ulp here).
        const NovoGradStep used = constants.get();
        const NovoGradStep host = make_novograd_constants(config, steps_taken, kLr, kLossScale);
        REQUIRE(floats_within_ulps(used.bias_correction1, host.bias_correction1, 1));
        REQUIRE(floats_within_ulps(used.bias_correction2, host.bias_correction2, 1));
        REQUIRE(used.beta1 == host.beta1);
        REQUIRE(used.beta3 == host.beta3);
        REQUIRE(used.beta2 == host.beta2);
        REQUIRE(used.one_minus_beta2 == host.one_minus_beta2);
        REQUIRE(used.eps == host.eps);
        REQUIRE(used.decay == host.decay);
        REQUIRE(used.decayed == host.decayed);
        REQUIRE(used.lr == kLr);
        REQUIRE(used.grad_scale == kLossScale);
        REQUIRE(used.max_norm == config.max_norm);
        REQUIRE(used.reg_inside_moment == config.reg_inside_moment);
        REQUIRE(used.seed == (!config.init_zero && steps_taken == 0.0f));
        REQUIRE(used.steps_taken == steps_taken);

        const std::vector<double> device_reductions = download_array(reductions.device, n);
        require_matches_cpu(slots, with_masters, write_grads, used, device_reductions);

        // A skipped step writes nothing but scratch: params, grads, moments, masters, running
        // norms and the step count stay as they are.
        const std::vector<std::vector<unsigned char>> before = download_slots(slots);
        found.set(1.0f);
        cuda::novograd(lists.P, lists.G, lists.M, lists.A, lists.W, config, scalars, true,
                       constants.device, chunk_partials.device, chunk_owner.device,
                       reductions.device, nullptr);
        check(cudaDeviceSynchronize());
        REQUIRE(step.get() == steps_taken + 1.0f);
        REQUIRE(download_slots(slots) == before);
      });
}

TEST_CASE("CUDA NovoGrad in two halves (norms, then apply) is the one-call step bit for bit") {
  for_each_novograd_case(
      [](const NovoGradConfig& config, float steps_taken, bool with_masters, bool write_grads) {
        // One set of tensors steps in one call, the other in two (the reductions passed
        // from the first half to the second unchanged: one device, nothing to combine).
        const bool zero_norms = config.init_zero && steps_taken == 0.0f;
        const Slots one = novograd_slots(zero_norms);
        const Slots two = novograd_slots(zero_norms);
        const NovoGradLists a(one, with_masters), b(two, with_masters);
        const std::size_t n = one.size();
        const std::int64_t chunks = cuda::novograd_scratch_chunks(a.P);
        REQUIRE(chunks == kSlotChunks);
        DeviceArray<float> chunk_partials(chunks);
        DeviceArray<std::int32_t> chunk_owner(chunks);
        DeviceArray<double> reductions_a(static_cast<std::int64_t>(n)),
            reductions_b(static_cast<std::int64_t>(n));
        DeviceScalar<NovoGradStep> constants_a(NovoGradStep{}), constants_b(NovoGradStep{});
        DeviceScalar<float> step_a(steps_taken), step_b(steps_taken), lr(kLr), scale(kLossScale),
            found(0.0f);
        const StepScalars scalars_a{step_a.device, lr.device, scale.device, found.device};
        const StepScalars scalars_b{step_b.device, lr.device, scale.device, found.device};

        cuda::novograd(a.P, a.G, a.M, a.A, a.W, config, scalars_a, write_grads, constants_a.device,
                       chunk_partials.device, chunk_owner.device, reductions_a.device, nullptr,
                       NovoGradPart::kBoth);
        check(cudaDeviceSynchronize());
        REQUIRE(step_a.get() == steps_taken + 1.0f);
        const NovoGradStep used = constants_a.get();
        const std::vector<double> host_reductions = download_array(reductions_a.device, n);

        // The first half: only the reductions are written; the grads are only read (the
        // write-back is the second pass's), and the count is kept.
        const std::vector<std::vector<unsigned char>> untouched = download_slots(two);
        cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, write_grads, constants_b.device,
                       chunk_partials.device, chunk_owner.device, reductions_b.device, nullptr,
                       NovoGradPart::kNorms);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == steps_taken);
        REQUIRE(download_slots(two) == untouched);
        REQUIRE(download_array(reductions_b.device, n) == host_reductions);

        // The second half, as the op runs it: no chunk scratch (it reads no partials).
        cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, write_grads, constants_b.device,
                       nullptr, nullptr, reductions_b.device, nullptr, NovoGradPart::kApply);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == steps_taken + 1.0f);
        const NovoGradStep used_b = constants_b.get();
        REQUIRE(used_b.steps_taken == used.steps_taken);
        REQUIRE(used_b.bias_correction1 == used.bias_correction1);
        REQUIRE(used_b.bias_correction2 == used.bias_correction2);
        REQUIRE(used_b.seed == used.seed);
        REQUIRE(download_array(reductions_b.device, n) == host_reductions);
        REQUIRE(download_slots(two) == download_slots(one));
        REQUIRE(one[0]->param.download() != one[0]->param.host);  // the step did move them

        // And kBoth's step is the CPU's, as in the one-call test.
        require_matches_cpu(one, with_masters, write_grads, used, host_reductions);

        // Skipped halves write nothing but the constants: no tensor, reduction or count.
        const std::vector<std::vector<unsigned char>> before = download_slots(two);
        found.set(1.0f);
        cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, true, constants_b.device,
                       chunk_partials.device, chunk_owner.device, reductions_b.device, nullptr,
                       NovoGradPart::kNorms);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == steps_taken + 1.0f);
        REQUIRE(download_slots(two) == before);
        REQUIRE(download_array(reductions_b.device, n) == host_reductions);
        check(cudaMemset(reductions_b.device, 0, sizeof(double) * n));  // would change norms
        cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, true, constants_b.device,
                       nullptr, nullptr, reductions_b.device, nullptr, NovoGradPart::kApply);
        check(cudaDeviceSynchronize());
        REQUIRE(step_b.get() == steps_taken + 1.0f);
        REQUIRE(download_slots(two) == before);
      });
}

// The bf16 master modes: bf16 params, the mode's extra array (kahan compensations, or split's
// low halves, here any bf16 bit patterns) and, for stochastic, param ids keying the bits; the
// norms pass is the fp32 path's. From the GPU's reductions, the CPU's blend and
// novograd_bf16_span (with the same key per param) give its running norms, moments, grads,
// params and extra arrays bit for bit. A skipped step writes nothing.
TEST_CASE("CUDA NovoGrad's bf16 modes are bit-identical to the CPU spans, and skip on overflow") {
  const std::vector<std::int32_t> ids = {11, 12, 13, 14};
  for (const MasterMode mode : {MasterMode::kStochastic, MasterMode::kKahan, MasterMode::kSplit}) {
    INFO("mode " << static_cast<int>(mode));
    const bool stochastic = mode == MasterMode::kStochastic;
    Slots slots;
    slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kFloat16, 3 * 65536 + 5, 0, 10));
    slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kFloat32, 65536 + 3, 1, 20));
    slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kBFloat16, 7, 0, 30));
    slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kBFloat16, 0, 0, 40));
    NovoGradLists lists(slots, false);
    std::vector<std::unique_ptr<DeviceTensor>> extras;
    for (std::size_t t = 0; t < slots.size(); ++t) {
      extras.emplace_back(new DeviceTensor(DType::kBFloat16, slots[t]->n + slots[t]->offset,
                                           static_cast<std::uint32_t>(50 + t), -1e-3f, 1e-3f));
      if (!stochastic) lists.W.push_back(slots[t]->at(*extras[t]));
    }
    const MasterListMode how{mode, 9, stochastic ? ids : std::vector<std::int32_t>{}};
    const std::size_t n = slots.size();
    const std::int64_t chunks = cuda::novograd_scratch_chunks(lists.P);
    DeviceArray<float> chunk_partials(chunks);
    DeviceArray<std::int32_t> chunk_owner(chunks);
    DeviceArray<double> reductions(static_cast<std::int64_t>(n));
    DeviceScalar<NovoGradStep> constants(NovoGradStep{});
    DeviceScalar<float> step(3.0f), lr(kLr), scale(kLossScale), found(0.0f);
    const StepScalars scalars{step.device, lr.device, scale.device, found.device};
    const auto run = [&] {
      cuda::novograd(lists.P, lists.G, lists.M, lists.A, lists.W, kNovoGradConfigs[0], scalars,
                     true, constants.device, chunk_partials.device, chunk_owner.device,
                     reductions.device, nullptr, NovoGradPart::kBoth, how);
      check(cudaDeviceSynchronize());
    };
    run();
    const NovoGradStep used = constants.get();
    const std::vector<double> device_reductions = download_array(reductions.device, n);
    for (std::size_t t = 0; t < n; ++t) {
      NovoGradSlot& s = *slots[t];
      std::vector<unsigned char> p = s.param.host, g = s.grad.host, m = s.m.host,
                                 x = extras[t]->host;
      const auto bits = [&](std::vector<unsigned char>& h) {
        return reinterpret_cast<std::uint16_t*>(s.host_at(h, DType::kBFloat16));
      };
      const float norm = novograd_blend(initial_norm(s), device_reductions[t], used);
      const cpu::Bf16Span span{mode, stochastic ? nullptr : bits(x),
                               stochastic ? rounding_key(9, 3.0f, ids[t]) : RoundingKey{0u, 0u}, 0};
      cpu::novograd_bf16_span(bits(p), span, s.host_at(g, s.grad.dtype), s.grad.dtype, true,
                              reinterpret_cast<float*>(s.host_at(m, DType::kFloat32)), s.n, used,
                              novograd_denominator(norm, used));
      INFO("tensor " << t);
      REQUIRE(download_norm(s) == norm);
      REQUIRE(s.param.download() == p);
      REQUIRE(s.grad.download() == g);
      REQUIRE(s.m.download() == m);
      REQUIRE(extras[t]->download() == x);
    }
    std::vector<std::vector<unsigned char>> before = download_slots(slots);
    for (const auto& e : extras) before.push_back(e->download());
    found.set(1.0f);
    run();
    std::vector<std::vector<unsigned char>> after = download_slots(slots);
    for (const auto& e : extras) after.push_back(e->download());
    REQUIRE(after == before);
  }
}
