// cuda::novograd against the CPU NovoGrad spans (cpu_kernels.h), run the way the CPU op runs
// them: each tensor's reduction of its unscaled grads (novograd_norm_span), the blend into its
// running norm, then the update (novograd_apply_span) with the denominator of the new norm.
// The GPU adds the squares in another order than the CPU, so an L2 reduction may differ in its
// last bits (compared to a relative 1e-6); a max reduction is exact. Everything after the
// reduction is the same arithmetic on both: run from the GPU's own reductions, the CPU gives
// the GPU's running norms, moments, masters, params and written-back grads bit for bit.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cuda_kernels.h"
#include "cuda_test_buffers.h"
#include "launch_plan.h"
#include "novograd_math.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

namespace {

template <typename T>
struct NovoGradBuffer {
  T* device = nullptr;
  explicit NovoGradBuffer(std::int64_t n) {
    check(cudaMalloc(reinterpret_cast<void**>(&device), sizeof(T) * (n > 0 ? n : 1)));
  }
  NovoGradBuffer(const NovoGradBuffer&) = delete;
  ~NovoGradBuffer() { cudaFree(device); }
};

template <typename T>
std::vector<T> download_array(const T* device, std::size_t n) {
  std::vector<T> out(n);
  check(cudaMemcpy(out.data(), device, sizeof(T) * n, cudaMemcpyDeviceToHost));
  return out;
}

// Whether two floats are at most `ulps` apart on the ordered line of their bit patterns.
bool floats_within_ulps(float a, float b, std::int64_t ulps) {
  const auto ordered = [](float x) -> std::int64_t {
    std::uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const std::int64_t magnitude = bits & 0x7fffffffu;
    return bits & 0x80000000u ? -magnitude : magnitude;
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return (d < 0 ? -d : d) <= ulps;
}

// One tensor's param, grad, first moment and master, `offset` elements into their allocations
// (an offset of 1 breaks 16-byte alignment: the scalar path), and its one-element running norm.
struct NovoGradSlot {
  DType param_dtype;
  DType grad_dtype;
  std::int64_t n;
  std::int64_t offset;
  DeviceTensor param, grad, m, master, norm_avg;

  NovoGradSlot(DType p, DType g, std::int64_t size, std::int64_t off, std::uint32_t seed)
      : param_dtype(p), grad_dtype(g), n(size), offset(off),
        param(p, size + off, seed, -1.0f, 1.0f),
        // Grads as a 384 loss scale leaves them (not a power of two: the division rounds).
        grad(g, size + off, seed + 1, -64.0f, 64.0f),
        m(DType::kFloat32, size + off, seed + 2, -0.1f, 0.1f),
        master(DType::kFloat32, size + off, seed + 3, -1.0f, 1.0f),
        norm_avg(DType::kFloat32, 1, seed + 4, 0.5f, 2.0f) {}

  TensorRef at(DeviceTensor& t) const {
    return {static_cast<char*>(t.device) + offset * element_size(t.dtype), n, t.dtype};
  }
  unsigned char* host_at(std::vector<unsigned char>& h, DType dtype) const {
    return h.data() + offset * element_size(dtype);
  }
};

using Slots = std::vector<std::unique_ptr<NovoGradSlot>>;

// Sizes over 64K and not multiples of 4 (packs and a scalar tail, a tensor over several
// chunks), a tiny one, an unaligned one, and a tensor without elements (no chunk: its
// reduction is 0, and its running norm is still blended). Every param dtype appears, with grads
// of its own and of other dtypes. The same seeds on every call: two calls start from the same
// bits. With init_zero's first step the running norms start at 0, as the op's state does.
Slots novograd_slots(bool zero_norms) {
  Slots slots;
  slots.emplace_back(new NovoGradSlot(DType::kFloat32, DType::kFloat16, 3 * 65536 + 5, 0, 10));
  slots.emplace_back(new NovoGradSlot(DType::kFloat16, DType::kFloat16, 70001, 0, 20));
  slots.emplace_back(new NovoGradSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
  slots.emplace_back(new NovoGradSlot(DType::kFloat32, DType::kFloat32, 7, 0, 30));
  slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kFloat32, 65536 + 3, 1, 40));
  slots.emplace_back(new NovoGradSlot(DType::kBFloat16, DType::kBFloat16, 4099, 0, 50));
  if (zero_norms) {
    for (auto& s : slots) {
      s->norm_avg.set(0, 0.0f);
      s->norm_avg.upload();
    }
  }
  return slots;
}

// Chunks of novograd_slots: 4 + 2 + 0 + 1 + 2 + 1.
constexpr std::int64_t kSlotChunks = 10;

struct NovoGradLists {
  std::vector<TensorRef> P, G, M, A, W;
  NovoGradLists(const Slots& slots, bool with_masters) {
    for (const auto& s : slots) {
      P.push_back(s->at(s->param));
      G.push_back(s->at(s->grad));
      M.push_back(s->at(s->m));
      A.push_back(s->norm_avg.ref());
      if (with_masters) W.push_back(s->at(s->master));
    }
  }
};

// Every tensor's device bits (param, grad, m, master, norm_avg of each slot in turn).
std::vector<std::vector<unsigned char>> download_slots(const Slots& slots) {
  std::vector<std::vector<unsigned char>> out;
  for (const auto& s : slots) {
    for (const DeviceTensor* t : {&s->param, &s->grad, &s->m, &s->master, &s->norm_avg}) {
      out.push_back(t->download());
    }
  }
  return out;
}

// A slot's running norm on the device, and as it was before the step.
float download_norm(const NovoGradSlot& s) {
  return download_array(static_cast<const float*>(s.norm_avg.device), 1)[0];
}

float initial_norm(const NovoGradSlot& s) {
  float norm;
  std::memcpy(&norm, s.norm_avg.host.data(), sizeof(norm));
  return norm;
}

// Host copies of one slot's tensors (as they were before the step), stepped by the CPU spans
// the way the CPU op steps them.
struct HostStep {
  NovoGradSlot& slot;
  std::vector<unsigned char> p, g, m, w;
  float norm_avg;
  float* master;

  HostStep(NovoGradSlot& s, bool with_masters)
      : slot(s), p(s.param.host), g(s.grad.host), m(s.m.host), w(s.master.host),
        norm_avg(initial_norm(s)),
        master(with_masters ? reinterpret_cast<float*>(s.host_at(w, DType::kFloat32))
                            : nullptr) {}

  // The first pass: the reduction of the unscaled grads (the grads are only read).
  double reduction(const NovoGradStep& step) {
    return cpu::novograd_norm_span(slot.host_at(g, slot.grad_dtype), slot.grad_dtype, slot.n,
                                   step.grad_scale, step.max_norm);
  }
  // The blend and the second pass, from a reduction of this tensor's grads.
  void blend_and_apply(double reduction, bool write_grads, const NovoGradStep& step) {
    norm_avg = novograd_blend(norm_avg, reduction, step);
    cpu::novograd_apply_span(slot.host_at(p, slot.param_dtype), slot.param_dtype,
                             slot.host_at(g, slot.grad_dtype), slot.grad_dtype, write_grads,
                             reinterpret_cast<float*>(slot.host_at(m, DType::kFloat32)), master,
                             slot.n, step, novograd_denominator(norm_avg, step));
  }
};

// Config fields: beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
// reg_inside_moment, max_norm, init_zero. apex's defaults (L2, decay after the moment); L2
// with the decay inside the moment, init_zero and no grad averaging; the max norm, inside,
// without bias correction or decay; the max norm, decay after, init_zero.
const NovoGradConfig kConfigs[] = {
    {0.95, 0.98, 1e-8, 0.001, true, true, false, false, false},
    {0.9, 0.999, 1e-6, 0.01, true, false, true, false, true},
    {0.9, 0.99, 1e-8, 0.0, false, true, true, true, false},
    {0.95, 0.98, 1e-8, 0.01, true, true, false, true, true}};

// Step counts before the step: the first step (the seed without init_zero), and a later one.
const float kStepsTaken[] = {0.0f, 3.0f};

constexpr float kLr = 1e-2f;
constexpr float kLossScale = 384.0f;

// The GPU's reduction against the CPU's: exact for the max norm, a relative 1e-6 for L2.
void require_reduction_close(double gpu, double cpu, bool max_norm) {
  if (max_norm) {
    REQUIRE(gpu == cpu);
  } else {
    REQUIRE(std::abs(gpu - cpu) <= 1e-6 * cpu);
  }
}

// Steps every slot on the CPU and compares with the GPU's step: the reductions against
// `device_reductions`, the running norms from the CPU's own reductions to a relative 1e-6
// (exact with the max norm), and everything from the GPU's reductions bit for bit.
void require_matches_cpu(const Slots& slots, bool with_masters, bool write_grads,
                         const NovoGradStep& used, const std::vector<double>& device_reductions) {
  for (std::size_t t = 0; t < slots.size(); ++t) {
    NovoGradSlot& s = *slots[t];
    HostStep own(s, with_masters);
    HostStep host(s, with_masters);
    const double cpu_reduction = own.reduction(used);
    INFO("tensor " << t << " (" << s.n << " elements): reduction " << cpu_reduction << " (GPU "
                   << device_reductions[t] << ")");
    require_reduction_close(device_reductions[t], cpu_reduction, used.max_norm);
    REQUIRE((s.n == 0) == (cpu_reduction == 0.0));
    own.blend_and_apply(cpu_reduction, write_grads, used);
    host.blend_and_apply(device_reductions[t], write_grads, used);

    const float gpu_norm = download_norm(s);
    if (used.max_norm) {
      REQUIRE(gpu_norm == own.norm_avg);
    } else {
      REQUIRE(std::abs(gpu_norm - own.norm_avg) <= 1e-6f * own.norm_avg);
    }
    REQUIRE(gpu_norm == host.norm_avg);
    REQUIRE(s.m.download() == host.m);
    REQUIRE(s.grad.download() == host.g);
    REQUIRE(s.param.download() == host.p);
    REQUIRE(s.master.download() == host.w);
    if (s.n == 0) continue;
    // The step did move the norm and the fp32 params (a 16-bit param's step may round away).
    REQUIRE(gpu_norm != initial_norm(s));
    const DeviceTensor& moved = with_masters ? s.master : s.param;
    if (with_masters || s.param_dtype == DType::kFloat32) {
      REQUIRE(moved.download() != moved.host);
    }
  }
}

}  // namespace

TEST_CASE("CUDA NovoGrad matches the CPU NovoGrad spans, and skips on overflow") {
  for (const NovoGradConfig& config : kConfigs) {
    for (float steps_taken : kStepsTaken) {
      for (bool with_masters : {false, true}) {
        for (bool write_grads : {false, true}) {
          INFO("max_norm " << config.max_norm << ", reg_inside_moment "
                           << config.reg_inside_moment << ", init_zero " << config.init_zero
                           << ", steps taken " << steps_taken << ", masters " << with_masters
                           << ", write_grads " << write_grads);
          const Slots slots = novograd_slots(config.init_zero && steps_taken == 0.0f);
          const NovoGradLists lists(slots, with_masters);
          const std::size_t n = slots.size();
          const std::int64_t chunks = cuda::novograd_scratch_chunks(lists.P);
          REQUIRE(chunks == kSlotChunks);
          NovoGradBuffer<float> chunk_partials(chunks);
          NovoGradBuffer<std::int32_t> chunk_owner(chunks);
          NovoGradBuffer<double> reductions(static_cast<std::int64_t>(n));
          DeviceScalar<NovoGradStep> constants(NovoGradStep{});
          DeviceScalar<float> step(steps_taken), lr(kLr), scale(kLossScale), found(0.0f);
          const StepScalars scalars{step.device, lr.device, scale.device, found.device};

          cuda::novograd(lists.P, lists.G, lists.M, lists.A, lists.W, config, scalars,
                         write_grads, constants.device, chunk_partials.device,
                         chunk_owner.device, reductions.device, nullptr);
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
        }
      }
    }
  }
}

TEST_CASE("CUDA NovoGrad over an empty list only advances the step count") {
  DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
  DeviceScalar<NovoGradStep> constants(NovoGradStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const std::vector<TensorRef> none;
  REQUIRE(cuda::novograd_scratch_chunks(none) == 0);
  cuda::novograd(none, none, none, none, none, kConfigs[0], scalars, false, constants.device,
                 nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
  REQUIRE(constants.get().steps_taken == 7.0f);
  REQUIRE(constants.get().grad_scale == 1.0f);  // no loss scale given
  found.set(1.0f);
  cuda::novograd(none, none, none, none, none, kConfigs[0], scalars, false, constants.device,
                 nullptr, nullptr, nullptr, nullptr);
  REQUIRE(step.get() == 8.0f);
}

TEST_CASE("CUDA NovoGrad needs tensor_reductions for a list that is not empty") {
  const Slots slots = novograd_slots(false);
  const NovoGradLists l(slots, false);
  DeviceScalar<float> step(0.0f), lr(1e-3f);
  DeviceScalar<NovoGradStep> constants(NovoGradStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, nullptr};
  REQUIRE_THROWS_AS(cuda::novograd(l.P, l.G, l.M, l.A, l.W, kConfigs[0], scalars, false,
                                   constants.device, nullptr, nullptr, nullptr, nullptr),
                    std::invalid_argument);
  REQUIRE(step.get() == 0.0f);  // refused before anything was queued
}

TEST_CASE("CUDA NovoGrad in two halves (norms, then apply) is the one-call step bit for bit") {
  for (const NovoGradConfig& config : kConfigs) {
    for (float steps_taken : kStepsTaken) {
      for (bool with_masters : {false, true}) {
        for (bool write_grads : {false, true}) {
          INFO("max_norm " << config.max_norm << ", reg_inside_moment "
                           << config.reg_inside_moment << ", init_zero " << config.init_zero
                           << ", steps taken " << steps_taken << ", masters " << with_masters
                           << ", write_grads " << write_grads);
          // One set of tensors steps in one call, the other in two (the reductions passed
          // from the first half to the second unchanged: one device, nothing to combine).
          const bool zero_norms = config.init_zero && steps_taken == 0.0f;
          const Slots one = novograd_slots(zero_norms);
          const Slots two = novograd_slots(zero_norms);
          const NovoGradLists a(one, with_masters), b(two, with_masters);
          const std::size_t n = one.size();
          const std::int64_t chunks = cuda::novograd_scratch_chunks(a.P);
          REQUIRE(chunks == kSlotChunks);
          NovoGradBuffer<float> chunk_partials(chunks);
          NovoGradBuffer<std::int32_t> chunk_owner(chunks);
          NovoGradBuffer<double> reductions_a(static_cast<std::int64_t>(n)),
              reductions_b(static_cast<std::int64_t>(n));
          DeviceScalar<NovoGradStep> constants_a(NovoGradStep{}), constants_b(NovoGradStep{});
          DeviceScalar<float> step_a(steps_taken), step_b(steps_taken), lr(kLr),
              scale(kLossScale), found(0.0f);
          const StepScalars scalars_a{step_a.device, lr.device, scale.device, found.device};
          const StepScalars scalars_b{step_b.device, lr.device, scale.device, found.device};

          cuda::novograd(a.P, a.G, a.M, a.A, a.W, config, scalars_a, write_grads,
                         constants_a.device, chunk_partials.device, chunk_owner.device,
                         reductions_a.device, nullptr, NovoGradPart::kBoth);
          check(cudaDeviceSynchronize());
          REQUIRE(step_a.get() == steps_taken + 1.0f);
          const NovoGradStep used = constants_a.get();
          const std::vector<double> host_reductions = download_array(reductions_a.device, n);

          // The first half: only the reductions are written; the grads are only read (the
          // write-back is the second pass's), and the count is kept.
          const std::vector<std::vector<unsigned char>> untouched = download_slots(two);
          cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, write_grads,
                         constants_b.device, chunk_partials.device, chunk_owner.device,
                         reductions_b.device, nullptr, NovoGradPart::kNorms);
          check(cudaDeviceSynchronize());
          REQUIRE(step_b.get() == steps_taken);
          REQUIRE(download_slots(two) == untouched);
          REQUIRE(download_array(reductions_b.device, n) == host_reductions);

          // The second half, as the op runs it: no chunk scratch (it reads no partials).
          cuda::novograd(b.P, b.G, b.M, b.A, b.W, config, scalars_b, write_grads,
                         constants_b.device, nullptr, nullptr, reductions_b.device, nullptr,
                         NovoGradPart::kApply);
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
        }
      }
    }
  }
}

TEST_CASE("CUDA NovoGrad on a shard without elements: zero reductions, norms still blended") {
  // FSDP2 may leave a rank no element of a tensor: its reduction (0) still joins the
  // all-reduce, and its running norm is blended with it as on every other rank.
  for (const NovoGradConfig& config : {kConfigs[0], kConfigs[3]}) {
    INFO("max_norm " << config.max_norm);
    Slots empty;
    empty.emplace_back(new NovoGradSlot(DType::kFloat32, DType::kFloat32, 0, 1, 25));
    empty.emplace_back(new NovoGradSlot(DType::kFloat16, DType::kBFloat16, 0, 0, 35));
    const NovoGradLists l(empty, true);
    REQUIRE(cuda::novograd_scratch_chunks(l.P) == 0);
    NovoGradBuffer<double> reductions(2);
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
      NovoGradBuffer<float> chunk_partials(chunks);
      NovoGradBuffer<std::int32_t> chunk_owner(chunks);
      NovoGradBuffer<double> reductions(2);
      DeviceScalar<NovoGradStep> constants(NovoGradStep{});
      DeviceScalar<float> step(3.0f), lr(1e-3f), scale(kLossScale);
      const StepScalars scalars{step.device, lr.device, scale.device, nullptr};
      cuda::novograd(l.P, l.G, l.M, l.A, l.W, kConfigs[2], scalars, false, constants.device,
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
  const NovoGradConfig& config = kConfigs[0];
  Slots slots;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (int i = 0; i < 1300; ++i) {
    const std::int64_t size = i % 97 == 0 ? 0 : 1 + i % 13;
    slots.emplace_back(new NovoGradSlot(dtypes[i % 3], dtypes[(i / 3) % 3], size, i % 2,
                                        static_cast<std::uint32_t>(1000 + 10 * i)));
  }
  for (bool with_masters : {false, true}) {
    INFO("masters " << with_masters);
    for (auto& s : slots) {  // the same start for both passes of the loop
      for (DeviceTensor* t : {&s->param, &s->grad, &s->m, &s->master, &s->norm_avg}) {
        t->upload();
      }
    }
    const NovoGradLists l(slots, with_masters);
    const std::int64_t chunks = cuda::novograd_scratch_chunks(l.P);
    REQUIRE(chunks == 1300 - 14);  // one chunk per tensor but the 14 empty ones
    NovoGradBuffer<float> chunk_partials(chunks);
    NovoGradBuffer<std::int32_t> chunk_owner(chunks);
    NovoGradBuffer<double> reductions(static_cast<std::int64_t>(slots.size()));
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
