// cuda::novograd at its edges: an empty list, a missing reductions array, a shard without
// elements, a NaN grad under the max norm, and more tensors than one launch holds. The CPU
// reference is cuda_novograd_slots.h's.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_novograd_slots.h"
#include "cuda_test_buffers.h"
#include "launch_plan.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

TEST_CASE("CUDA NovoGrad over an empty list only advances the step count") {
  DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
  DeviceScalar<NovoGradStep> constants(NovoGradStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const std::vector<TensorRef> none;
  REQUIRE(cuda::novograd_scratch_chunks(none) == 0);
  cuda::novograd(none, none, none, none, none, kNovoGradConfigs[0], scalars, false,
                 constants.device, nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
  REQUIRE(constants.get().steps_taken == 7.0f);
  REQUIRE(constants.get().grad_scale == 1.0f);  // no loss scale given
  found.set(1.0f);
  cuda::novograd(none, none, none, none, none, kNovoGradConfigs[0], scalars, false,
                 constants.device, nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
}

TEST_CASE("CUDA NovoGrad needs tensor_reductions for a list that is not empty") {
  const Slots slots = novograd_slots(false);
  const NovoGradLists l(slots, false);
  DeviceScalar<float> step(0.0f), lr(1e-3f);
  DeviceScalar<NovoGradStep> constants(NovoGradStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, nullptr};
  REQUIRE_THROWS_AS(cuda::novograd(l.P, l.G, l.M, l.A, l.W, kNovoGradConfigs[0], scalars, false,
                                   constants.device, nullptr, nullptr, nullptr, nullptr),
                    std::invalid_argument);
  REQUIRE(step.get() == 0.0f);  // refused before anything was queued
}

TEST_CASE("CUDA NovoGrad on a shard without elements: zero reductions, norms still blended") {
  // FSDP2 may leave a rank no element of a tensor: its reduction (0) still joins the
  // all-reduce, and its running norm is blended with it as on every other rank.
  for (const NovoGradConfig& config : {kNovoGradConfigs[0], kNovoGradConfigs[3]}) {
    INFO("max_norm " << config.max_norm);
    Slots empty;
    empty.emplace_back(new NovoGradSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
    empty.emplace_back(new NovoGradSlot(DType::kFloat16, DType::kBFloat16, 0, 0, 35));
    const NovoGradLists l(empty, true);
    REQUIRE(cuda::novograd_scratch_chunks(l.P) == 0);
    DeviceArray<double> reductions(2);
    check(cudaMemset(reductions.device, 0xff, 2 * sizeof(double)));  // NaN bits
    DeviceScalar<NovoGradStep> constants(NovoGradStep{});
    DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
    const StepScalars scalars{step.device, lr.device, nullptr, found.device};
    const std::vector<std::vector<unsigned char>> before = download_slots(empty);

    cuda::novograd(l.P, l.G, l.M, l.A, l.W, config, scalars, true, constants.device, nullptr,
                   nullptr, reductions.device, nullptr, NovoGradPart::kNorms);
    check(cudaDeviceSynchronize());
    REQUIRE(step.get() == 7.0f);
    REQUIRE(download_array(reductions.device, 2) == std::vector<double>{0.0, 0.0});
    REQUIRE(download_slots(empty) == before);

    cuda::novograd(l.P, l.G, l.M, l.A, l.W, config, scalars, false, constants.device, nullptr,
                   nullptr, reductions.device, nullptr, NovoGradPart::kApply);
    check(cudaDeviceSynchronize());
    REQUIRE(step.get() == 8.0f);
    const NovoGradStep used = constants.get();
    for (const auto& s : empty) {
      const float old = initial_norm(*s);
      const float blended = novograd_blend(old, 0.0, used);
      REQUIRE(blended < old);  // beta2 * old (max) or sqrt(beta2) * old (L2)
      REQUIRE(download_norm(*s) == blended);
      // Nothing else of an empty tensor is touched.
      REQUIRE(s->param.download() == s->param.host);
      REQUIRE(s->grad.download() == s->grad.host);
      REQUIRE(s->m.download() == s->m.host);
      REQUIRE(s->master.download() == s->master.host);
    }

    // kBoth on the same shard: the finishing launch still runs, with zero reductions.
    check(cudaMemset(reductions.device, 0xff, 2 * sizeof(double)));
    const float norm0 = download_norm(*empty[0]);
    cuda::novograd(l.P, l.G, l.M, l.A, l.W, config, scalars, false, constants.device, nullptr,
                   nullptr, reductions.device, nullptr, NovoGradPart::kBoth);
    check(cudaDeviceSynchronize());
    REQUIRE(step.get() == 9.0f);
    REQUIRE(download_array(reductions.device, 2) == std::vector<double>{0.0, 0.0});
    REQUIRE(download_norm(*empty[0]) == novograd_blend(norm0, 0.0, constants.get()));
  }
}

TEST_CASE("CUDA NovoGrad's max norm lets a NaN grad through, across threads and chunks") {
  // A NaN early in the first chunk and a larger |g| in a later chunk (and in other threads'
  // elements of the NaN's chunk): a max that dropped NaNs anywhere (a thread, a warp, the
  // block or the chunks) would return the large value instead.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    for (std::int64_t where : {std::int64_t{0}, std::int64_t{100}, std::int64_t{65536 + 513}}) {
      INFO("dtype " << static_cast<int>(dtype) << ", NaN at " << where);
      Slots slots;
      slots.emplace_back(new NovoGradSlot(DType::kFloat32, dtype, 3 * 65536 + 5, 0, 60));
      slots.emplace_back(new NovoGradSlot(DType::kFloat32, dtype, 1000, 0, 70));  // finite
      NovoGradSlot& s = *slots[0];
      s.grad.set(where, nan);
      s.grad.set(1, 60000.0f);
      s.grad.set(2 * 65536 + 7, 60000.0f);
      s.grad.upload();
      const NovoGradLists l(slots, false);
      const std::int64_t chunks = cuda::novograd_scratch_chunks(l.P);
      DeviceArray<float> chunk_partials(chunks);
      DeviceArray<std::int32_t> chunk_owner(chunks);
      DeviceArray<double> reductions(2);
      DeviceScalar<NovoGradStep> constants(NovoGradStep{});
      DeviceScalar<float> step(3.0f), lr(1e-3f), scale(kLossScale);
      const StepScalars scalars{step.device, lr.device, scale.device, nullptr};
      cuda::novograd(l.P, l.G, l.M, l.A, l.W, kNovoGradConfigs[2], scalars, false, constants.device,
                     chunk_partials.device, chunk_owner.device, reductions.device, nullptr,
                     NovoGradPart::kNorms);
      check(cudaDeviceSynchronize());
      const std::vector<double> r = download_array(reductions.device, 2);
      HostStep host(s, false), finite(*slots[1], false);
      const NovoGradStep used = constants.get();
      REQUIRE(std::isnan(host.reduction(used)));
      REQUIRE(std::isnan(r[0]));
      REQUIRE(r[1] == finite.reduction(used));  // the NaN stays in its own tensor
      REQUIRE(std::isfinite(r[1]));
    }
  }
}

TEST_CASE("CUDA NovoGrad over more tensors than one launch's table holds") {
  // 1300 tensors pass the per-launch tensor caps of every launch (1268 at depth 1, fewer at
  // depth 5), so each launch's list_index must map its tensors back to the right ones.
  const NovoGradConfig& config = kNovoGradConfigs[0];
  Slots slots;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (int i = 0; i < 1300; ++i) {
    const std::int64_t size = i % 97 == 0 ? 0 : 1 + i % 13;
    slots.emplace_back(new NovoGradSlot(dtypes[i % 3], dtypes[(i / 3) % 3], size, i % 2,
                                        static_cast<std::uint32_t>(1000 + 10 * i)));
  }
  for (bool with_masters : {false, true}) {
    INFO("masters " << with_masters);
    for (auto& s : slots) s->upload();  // the same start for both passes of the loop
    const NovoGradLists l(slots, with_masters);
    const std::int64_t chunks = cuda::novograd_scratch_chunks(l.P);
    REQUIRE(chunks == 1300 - 14);  // one chunk per tensor but the 14 empty ones
    DeviceArray<float> chunk_partials(chunks);
    DeviceArray<std::int32_t> chunk_owner(chunks);
    DeviceArray<double> reductions(static_cast<std::int64_t>(slots.size()));
    DeviceScalar<NovoGradStep> constants(NovoGradStep{});
    DeviceScalar<float> step(3.0f), lr(kLr), scale(kLossScale);
    const StepScalars scalars{step.device, lr.device, scale.device, nullptr};
    cuda::novograd(l.P, l.G, l.M, l.A, l.W, config, scalars, true, constants.device,
                   chunk_partials.device, chunk_owner.device, reductions.device, nullptr);
    check(cudaDeviceSynchronize());
    REQUIRE(step.get() == 4.0f);
    require_matches_cpu(slots, with_masters, true, constants.get(),
                        download_array(reductions.device, slots.size()));
  }
}
