// The tensors and the CPU reference of the CUDA NovoGrad tests (test_cuda_novograd.cpp,
// test_cuda_novograd_edge_cases.cpp). The CPU reference runs the CPU spans (cpu_kernels.h) the
// way the CPU op runs them: each tensor's reduction of its unscaled grads
// (novograd_norm_span), the blend into its running norm, then the update (novograd_apply_span)
// with the denominator of the new norm. The GPU adds the squares in another order than the
// CPU, so an L2 reduction may differ in its last bits (compared to a relative 1e-6); a max
// reduction is exact. Everything after the reduction is the same arithmetic on both: run from
// the GPU's own reductions, the CPU gives the GPU's running norms, moments, masters, params and
// written-back grads bit for bit.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cuda_test_buffers.h"
#include "novograd_math.h"

namespace ampfuse::kernels::test {

// One tensor's param, grad, first moment and master, and its one-element running norm.
struct NovoGradSlot : OptimizerSlot {
  DeviceTensor master, norm_avg;

  // Grads as a 384 loss scale leaves them (not a power of two: the division rounds).
  NovoGradSlot(DType p, DType g, std::int64_t size, std::int64_t off, std::uint32_t seed)
      : OptimizerSlot(p, g, size, off, seed, /*grad_bound=*/64.0f),
        master(DType::kFloat32, size + off, seed + 3, -1.0f, 1.0f),
        norm_avg(DType::kFloat32, 1, seed + 4, 0.5f, 2.0f) {}

  // The order of download_slots.
  std::vector<const DeviceTensor*> tensors() const {
    return {&param, &grad, &m, &master, &norm_avg};
  }
  // Back to the bits the slot was made with.
  void upload() {
    for (DeviceTensor* t : {&param, &grad, &m, &master, &norm_avg}) t->upload();
  }
};

using Slots = std::vector<std::unique_ptr<NovoGradSlot>>;

// Sizes over 64K and not multiples of 4 (packs and a scalar tail, a tensor over several
// chunks), a tiny one, an unaligned one, and a tensor without elements (no chunk: its
// reduction is 0, and its running norm is still blended). Every param dtype appears, with grads
// of its own and of other dtypes. The same seeds on every call: two calls start from the same
// bits. With init_zero's first step the running norms start at 0, as the op's state does.
inline Slots novograd_slots(bool zero_norms) {
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

// A slot's running norm on the device, and as it was before the step.
inline float download_norm(const NovoGradSlot& s) {
  return download_array(static_cast<const float*>(s.norm_avg.device), 1)[0];
}

inline float initial_norm(const NovoGradSlot& s) {
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
      : slot(s),
        p(s.param.host),
        g(s.grad.host),
        m(s.m.host),
        w(s.master.host),
        norm_avg(initial_norm(s)),
        master(with_masters ? reinterpret_cast<float*>(s.host_at(w, DType::kFloat32)) : nullptr) {}

  // The first pass: the reduction of the unscaled grads (the grads are only read).
  double reduction(const NovoGradStep& step) {
    return cpu::novograd_norm_span(slot.host_at(g, slot.grad.dtype), slot.grad.dtype, slot.n,
                                   step.grad_scale, step.max_norm);
  }
  // The blend and the second pass, from a reduction of this tensor's grads.
  void blend_and_apply(double reduction, bool write_grads, const NovoGradStep& step) {
    norm_avg = novograd_blend(norm_avg, reduction, step);
    cpu::novograd_apply_span(slot.host_at(p, slot.param.dtype), slot.param.dtype,
                             slot.host_at(g, slot.grad.dtype), slot.grad.dtype, write_grads,
                             reinterpret_cast<float*>(slot.host_at(m, DType::kFloat32)), master,
                             slot.n, step, novograd_denominator(norm_avg, step));
  }
};

// Config fields: beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
// reg_inside_moment, max_norm, init_zero. apex's defaults (L2, decay after the moment); L2
// with the decay inside the moment, init_zero and no grad averaging; the max norm, inside,
// without bias correction or decay; the max norm, decay after, init_zero.
const NovoGradConfig kNovoGradConfigs[] = {
    {0.95, 0.98, 1e-8, 0.001, true, true, false, false, false},
    {0.9, 0.999, 1e-6, 0.01, true, false, true, false, true},
    {0.9, 0.99, 1e-8, 0.0, false, true, true, true, false},
    {0.95, 0.98, 1e-8, 0.01, true, true, false, true, true}};

// Step counts before the step: the first step (the seed without init_zero), and a later one.
const float kStepsTaken[] = {0.0f, 3.0f};

constexpr float kLr = 1e-2f;
constexpr float kLossScale = 384.0f;

// Calls f(config, steps_taken, with_masters, write_grads) for every config, step count, with
// and without masters and grad write-back, each call named in the failure messages.
template <typename F>
void for_each_novograd_case(F&& f) {
  for (const NovoGradConfig& config : kNovoGradConfigs) {
    for (float steps_taken : kStepsTaken) {
      for (bool with_masters : {false, true}) {
        for (bool write_grads : {false, true}) {
          INFO("max_norm " << config.max_norm << ", reg_inside_moment " << config.reg_inside_moment
                           << ", init_zero " << config.init_zero << ", steps taken " << steps_taken
                           << ", masters " << with_masters << ", write_grads " << write_grads);
          f(config, steps_taken, with_masters, write_grads);
        }
      }
    }
  }
}

// The GPU's reduction against the CPU's: exact for the max norm, a relative 1e-6 for L2.
inline void require_reduction_close(double gpu, double cpu, bool max_norm) {
  if (max_norm) {
    REQUIRE(gpu == cpu);
  } else {
    REQUIRE(std::abs(gpu - cpu) <= 1e-6 * cpu);
  }
}

// Steps every slot on the CPU and compares with the GPU's step: the reductions against
// `device_reductions`, the running norms from the CPU's own reductions to a relative 1e-6
// (exact with the max norm), and everything from the GPU's reductions bit for bit.
inline void require_matches_cpu(const Slots& slots, bool with_masters, bool write_grads,
                                const NovoGradStep& used,
                                const std::vector<double>& device_reductions) {
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
    if (with_masters || s.param.dtype == DType::kFloat32) {
      REQUIRE(moved.download() != moved.host);
    }
  }
}

}  // namespace ampfuse::kernels::test
