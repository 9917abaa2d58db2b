// The CUDA launchers against the CPU kernels, on a GPU machine. Host code only
// (the CUDA runtime API), so it builds with the C++ compiler.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "cpu/half_convert.h"
#include "cuda_kernels.h"
#include "cuda_test_buffers.h"
#include "launch_plan.h"
#include "scale_rule.h"

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
const std::int64_t kSizes[] = {1, 7, 65535, 65536, 65537, 3 * 65536 + 5};

}  // namespace

TEST_CASE("CUDA unscale is bit-identical to the CPU kernel, over many tensors") {
  std::vector<std::unique_ptr<DeviceTensor>> tensors;
  std::vector<TensorRef> refs;
  for (int i = 0; i < 1300; ++i) {  // past the per-launch tensor cap (1268 at depth 1)
    tensors.push_back(std::make_unique<DeviceTensor>(kDtypes[i % 3], kSizes[i % 6], i));
    refs.push_back(tensors.back()->ref());
  }
  DeviceScalar<float> found(0.0f), inv(0.0625f);
  cuda::unscale(refs, found.device, inv.device, nullptr, nullptr);
  check(cudaDeviceSynchronize());
  REQUIRE(found.get() == 0.0f);
  for (auto& t : tensors) {
    std::vector<unsigned char> expected = t->host;
    cpu::unscale_span(expected.data(), t->dtype, t->numel, 0.0625f);
    REQUIRE(t->download() == expected);
  }
}

TEST_CASE("CUDA unscale and scale flag inf/nan at the first, middle and last element") {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (DType dtype : kDtypes) {
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{65537}}) {
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        for (float value : bad) {
          DeviceTensor t(dtype, n, 3);
          t.set(where, value);
          t.upload();
          std::vector<TensorRef> refs = {t.ref()};
          DeviceScalar<float> found(0.0f), inv(1.0f);
          cuda::unscale(refs, found.device, inv.device, nullptr, nullptr);
          REQUIRE(found.get() == 1.0f);
          DeviceTensor out(DType::kFloat32, n, 4);
          std::vector<TensorRef> dst = {out.ref()};
          DeviceScalar<float> found2(0.0f);
          cuda::scale(refs, dst, inv.device, found2.device, nullptr, nullptr);
          REQUIRE(found2.get() == 1.0f);
        }
      }
    }
  }
}

TEST_CASE("CUDA nonfinite_check reads only, and flags inf/nan at the first, middle and last") {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (DType dtype : kDtypes) {
    for (std::int64_t n : kSizes) {
      DeviceTensor clean(dtype, n, 5);
      std::vector<TensorRef> refs = {clean.ref()};
      DeviceScalar<float> found(0.0f);
      cuda::nonfinite_check(refs, found.device, nullptr, nullptr);
      REQUIRE(found.get() == 0.0f);
      REQUIRE(clean.download() == clean.host);
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        for (float value : bad) {
          DeviceTensor t(dtype, n, 6);
          t.set(where, value);
          t.upload();
          std::vector<TensorRef> one = {clean.ref(), t.ref()};
          DeviceScalar<float> flag(0.0f);
          cuda::nonfinite_check(one, flag.device, nullptr, nullptr);
          INFO("dtype " << int(dtype) << " n " << n << " at " << where);
          REQUIRE(flag.get() == 1.0f);
        }
      }
    }
  }
}

TEST_CASE("CUDA unscale, scale and check OR each tensor's inf/nan kinds into its flag") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Past the tensor cap of one launch, so list index and table slot differ for the last ones.
  const int count = ChunkTable<2>::kMaxTensors + 3;
  std::vector<std::unique_ptr<DeviceTensor>> tensors;
  std::vector<std::int32_t> expected(count, 0);
  for (int i = 0; i < count; ++i) {
    const std::int64_t n = i == count - 2 ? 2 * 65536 + 9 : 5;
    tensors.push_back(std::make_unique<DeviceTensor>(kDtypes[i % 3], n, 40 + i));
  }
  const auto plant = [&](int i, std::int64_t where, float value, std::int32_t kind) {
    tensors[i]->set(where, value);
    expected[i] |= kind;
  };
  plant(0, 0, inf, kHeldInf);
  plant(count - 2, 65536 + 3, nan, kHeldNan);
  plant(count - 2, 2 * 65536 + 8, -inf, kHeldInf);
  plant(count - 1, 4, nan, kHeldNan);
  std::vector<TensorRef> refs;
  std::vector<std::unique_ptr<DeviceTensor>> outputs;
  std::vector<TensorRef> dst;
  for (auto& t : tensors) {
    t->upload();
    refs.push_back(t->ref());
    outputs.push_back(std::make_unique<DeviceTensor>(DType::kFloat32, t->numel, 1));
    dst.push_back(outputs.back()->ref());
  }
  std::int32_t* flags = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&flags), count * sizeof(std::int32_t)));
  const auto run = [&](int op) {
    check(cudaMemset(flags, 0, count * sizeof(std::int32_t)));
    DeviceScalar<float> found(0.0f), factor(1.0f);
    if (op == 0) cuda::nonfinite_check(refs, found.device, flags, nullptr);
    if (op == 1) cuda::scale(refs, dst, factor.device, found.device, flags, nullptr);
    if (op == 2) cuda::unscale(refs, found.device, factor.device, flags, nullptr);
    std::vector<std::int32_t> got(count);
    check(cudaMemcpy(got.data(), flags, count * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    INFO("op " << op);
    REQUIRE(found.get() == 1.0f);
    REQUIRE(got == expected);
  };
  for (int op : {0, 1, 2}) run(op);
  cudaFree(flags);
}

// The list kernels test a whole 16-byte pack for inf/nan a 32-bit word at a time and load
// several packs per thread before using any (chunk_visit.h). Packs hold 4 (fp32) or 8 (2-byte
// types, and any fp32 -> 2-byte scale) elements, and a 512-thread block's batch slots are 2048
// or 4096 elements apart: these positions put the value in every lane of a pack and in every
// slot of a batch, for both element widths.
TEST_CASE("CUDA check, unscale and scale see inf/nan in every lane of a pack and batch slot") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int64_t> positions = {0, 1, 2, 3, 4, 5, 6, 7, 65535};
  for (std::int64_t slot = 1; slot < 4; ++slot) {
    for (std::int64_t lane : {0, 3, 7}) {
      positions.push_back(slot * 2048 + lane);
      positions.push_back(slot * 4096 + lane);
    }
  }
  const std::int64_t n = 65536;  // one full, aligned chunk: every element goes through packs
  std::int32_t* flags = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&flags), sizeof(std::int32_t)));
  const auto expect = [&](int op, const char* what, DeviceScalar<float>& found,
                          std::int32_t kinds) {
    std::int32_t got = 0;
    check(cudaMemcpy(&got, flags, sizeof(got), cudaMemcpyDeviceToHost));
    INFO(what << " op " << op);
    REQUIRE(found.get() == 1.0f);
    REQUIRE(got == kinds);
  };
  for (DType dtype : kDtypes) {
    for (std::int64_t where : positions) {
      for (int op = 0; op < 4; ++op) {
        INFO("dtype " << int(dtype) << " at " << where);
        // One inf alone, then an inf and a nan in the same pack (lanes 1 apart at least).
        for (int both = 0; both < 2; ++both) {
          DeviceTensor t(dtype, n, 70);
          t.set(where, -inf);
          std::int32_t kinds = kHeldInf;
          if (both == 1) {
            t.set(where ^ 1, nan);
            kinds |= kHeldNan;
          }
          t.upload();
          std::vector<TensorRef> refs = {t.ref()};
          DeviceTensor out(op == 3 ? DType::kFloat16 : DType::kFloat32, n, 71);
          std::vector<TensorRef> dst = {out.ref()};
          check(cudaMemset(flags, 0, sizeof(std::int32_t)));
          DeviceScalar<float> found(0.0f), factor(1.0f);
          if (op == 0) cuda::nonfinite_check(refs, found.device, flags, nullptr);
          if (op == 1) cuda::unscale(refs, found.device, factor.device, flags, nullptr);
          if (op >= 2) cuda::scale(refs, dst, factor.device, found.device, flags, nullptr);
          expect(op, both == 1 ? "inf and nan" : "inf", found, kinds);
        }
      }
    }
  }
  cudaFree(flags);
}

TEST_CASE("CUDA scale casts between every dtype pair like the CPU kernel, aligned or not") {
  for (DType from : kDtypes) {
    for (DType to : kDtypes) {
      for (std::int64_t n : kSizes) {
        DeviceTensor src(from, n, 5), dst(to, n, 6);
        // Offsetting by one element breaks 16-byte alignment: the scalar path runs.
        for (std::int64_t offset : {std::int64_t{0}, std::int64_t{1}}) {
          if (offset >= n) continue;
          const std::int64_t len = n - offset;
          std::vector<TensorRef> s = {
              {static_cast<char*>(src.device) + offset * element_size(from), len, from}};
          std::vector<TensorRef> d = {
              {static_cast<char*>(dst.device) + offset * element_size(to), len, to}};
          DeviceScalar<float> found(0.0f), factor(3.0f);
          cuda::scale(s, d, factor.device, found.device, nullptr, nullptr);
          std::vector<unsigned char> expected = dst.download();
          cpu::scale_span(src.host.data() + offset * element_size(from), from,
                          expected.data() + offset * element_size(to), to, len, 3.0f);
          REQUIRE(dst.download() == expected);
          REQUIRE(found.get() == 0.0f);
        }
      }
    }
  }
}

TEST_CASE("CUDA l2norm matches a float64 reference, globally and per tensor") {
  std::vector<std::unique_ptr<DeviceTensor>> tensors;
  std::vector<TensorRef> refs;
  std::vector<double> sums;
  for (int i = 0; i < 130; ++i) {
    const std::int64_t n = i == 7 ? 0 : kSizes[i % 6] * (i % 4 == 0 ? 5 : 1);
    tensors.push_back(std::make_unique<DeviceTensor>(kDtypes[i % 3], n, 100 + i, 2.0f));
    refs.push_back(tensors.back()->ref());
    sums.push_back(cpu::sum_of_squares_span(tensors.back()->host.data(), kDtypes[i % 3], n));
  }
  const std::int64_t chunks = cuda::l2norm_scratch_chunks(refs);
  float* chunk_sums = nullptr;
  std::int32_t* owners = nullptr;
  float* norms = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&chunk_sums), chunks * sizeof(float)));
  check(cudaMalloc(reinterpret_cast<void**>(&owners), chunks * sizeof(std::int32_t)));
  check(cudaMalloc(reinterpret_cast<void**>(&norms), (refs.size() + 1) * sizeof(float)));
  cuda::l2norm(refs, chunk_sums, owners, norms, norms + 1, nullptr);
  std::vector<float> got(refs.size() + 1);
  check(cudaMemcpy(got.data(), norms, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double total = 0.0;
  for (std::size_t i = 0; i < refs.size(); ++i) {
    total += sums[i];
    REQUIRE(got[i + 1] == Approx(std::sqrt(sums[i])).epsilon(1e-5).margin(0.0));
  }
  REQUIRE(got[0] == Approx(std::sqrt(total)).epsilon(1e-5));
  cudaFree(chunk_sums);
  cudaFree(owners);
  cudaFree(norms);
}

TEST_CASE("CUDA update_scale follows the host rule step by step") {
  std::mt19937 rng(9);
  DeviceScalar<float> scale(65536.0f), found(0.0f);
  DeviceScalar<std::int32_t> growth(0), hysteresis(2);
  float host_scale = 65536.0f;
  std::int32_t host_growth = 0, host_hysteresis = 2;
  for (int step = 0; step < 1000; ++step) {
    const float overflow = rng() % 10 == 0 ? 1.0f : 0.0f;
    found.set(overflow);
    cuda::update_scale(scale.device, growth.device, hysteresis.device, found.device, 2.0, 0.5, 7, 2,
                       1.0, 1e6, nullptr);
    apply_scale_rule(&host_scale, &host_growth, &host_hysteresis, overflow, 2.0, 0.5, 7, 2, 1.0,
                     1e6);
    REQUIRE(scale.get() == host_scale);
    REQUIRE(growth.get() == host_growth);
    REQUIRE(hysteresis.get() == host_hysteresis);
  }
}

// Reads the constants a CUDA prologue wrote.
template <typename Constants>
Constants download_constants(const void* device) {
  Constants c;
  check(cudaMemcpy(&c, device, sizeof(Constants), cudaMemcpyDeviceToHost));
  return c;
}

// Floats one unit in the last place apart at most.
bool within_one_ulp(float a, float b) { return a == b || std::nextafter(a, b) == b; }

// The FMA contract (docs/design/kernels.md): the element updates use explicitly rounded
// products on the GPU, so for the same inputs and step constants CUDA and CPU agree bit for
// bit. The constants themselves come from each platform's double-precision pow (as torch's
// fused optimizers use on each), whose last bit may differ, so they are compared to within
// one float ulp and the CPU reference runs with the constants the GPU used.
TEST_CASE("CUDA Adam and SGD are bit-identical to the CPU kernels, and skip on overflow") {
  const AdamConfig adam_config{0.9, 0.999, 1e-8, 0.01, true, true, true, false};
  DeviceScalar<AdamStep> adam_constants(AdamStep{});
  DeviceScalar<SgdStep> sgd_constants(SgdStep{});
  for (bool wd_after_momentum : {false, true}) {
    const SgdConfig sgd_config{0.9, 0.0, 0.01, true, false, wd_after_momentum};
    for (DType param_dtype : kDtypes) {
      for (DType grad_dtype : kDtypes) {
        // 65537 elements: packs and a scalar tail; offset 1 breaks 16-byte alignment.
        for (std::int64_t offset : {std::int64_t{0}, std::int64_t{1}}) {
          const std::int64_t n = offset == 0 ? 65537 : 5;
          DeviceTensor param(param_dtype, n + offset, 1, 1.0f),
              grad(grad_dtype, n + offset, 2, 1.0f);
          DeviceTensor m(DType::kFloat32, n + offset, 3, 0.1f),
              v(DType::kFloat32, n + offset, 4, 0.0f);
          DeviceTensor vmax(DType::kFloat32, n + offset, 5, 0.0f);
          DeviceTensor master(DType::kFloat32, n + offset, 6, 1.0f);
          DeviceScalar<float> step(3.0f), lr(1e-3f), scale(512.0f), found(0.0f);
          const StepScalars scalars{step.device, lr.device, scale.device, found.device};
          const auto at = [&](DeviceTensor& t) {
            return TensorRef{static_cast<char*>(t.device) + offset * element_size(t.dtype), n,
                             t.dtype};
          };
          const auto host_at = [&](std::vector<unsigned char>& h, DType dtype) {
            return h.data() + offset * element_size(dtype);
          };
          std::vector<TensorRef> P{at(param)}, G{at(grad)}, M{at(m)}, V{at(v)}, X{at(vmax)},
              W{at(master)};
          std::vector<unsigned char> p = param.host, g = grad.host, mm = m.host, vv = v.host,
                                     xx = vmax.host, ww = master.host;
          cuda::adam(P, G, M, V, X, W, adam_config, scalars, /*write_grads=*/true,
                     adam_constants.device, nullptr);
          const AdamStep used = download_constants<AdamStep>(adam_constants.device);
          const AdamStep host = make_step_constants(adam_config, 3.0f, 1e-3f, 512.0f);
          REQUIRE(within_one_ulp(used.step_size, host.step_size));
          REQUIRE(within_one_ulp(used.bias_correction2_sqrt, host.bias_correction2_sqrt));
          REQUIRE(used.decoupled_decay == host.decoupled_decay);
          REQUIRE(used.grad_scale == 512.0f);
          cpu::adam_span(host_at(p, param_dtype), param_dtype, host_at(g, grad_dtype), grad_dtype,
                         true, reinterpret_cast<float*>(host_at(mm, DType::kFloat32)),
                         reinterpret_cast<float*>(host_at(vv, DType::kFloat32)),
                         reinterpret_cast<float*>(host_at(xx, DType::kFloat32)),
                         reinterpret_cast<float*>(host_at(ww, DType::kFloat32)), n, used);
          REQUIRE(param.download() == p);
          REQUIRE(grad.download() == g);
          REQUIRE(master.download() == ww);
          REQUIRE(m.download() == mm);
          REQUIRE(vmax.download() == xx);
          REQUIRE(step.get() == 4.0f);
          // A skipped step writes nothing, the grads and the step count included.
          found.set(1.0f);
          cuda::adam(P, G, M, V, X, W, adam_config, scalars, true, adam_constants.device, nullptr);
          cuda::sgd(P, G, M, W, sgd_config, scalars, true, sgd_constants.device, nullptr);
          REQUIRE(param.download() == p);
          REQUIRE(grad.download() == g);
          REQUIRE(master.download() == ww);
          REQUIRE(step.get() == 4.0f);
          found.set(0.0f);
          cuda::sgd(P, G, M, W, sgd_config, scalars, false, sgd_constants.device, nullptr);
          const SgdStep sgd_used = download_constants<SgdStep>(sgd_constants.device);
          REQUIRE(!sgd_used.first_step);
          cpu::sgd_span(host_at(p, param_dtype), param_dtype, host_at(g, grad_dtype), grad_dtype,
                        false, reinterpret_cast<float*>(host_at(mm, DType::kFloat32)),
                        reinterpret_cast<float*>(host_at(ww, DType::kFloat32)), n,
                        make_step_constants(sgd_config, 4.0f, 1e-3f, 512.0f));
          REQUIRE(param.download() == p);
          REQUIRE(m.download() == mm);
          REQUIRE(grad.download() == g);
          REQUIRE(step.get() == 5.0f);
        }
      }
    }
  }
}

TEST_CASE("CUDA optimizer steps over an empty list only advance the step count") {
  DeviceScalar<float> step(7.0f), lr(1e-3f), found(0.0f);
  DeviceScalar<AdamStep> constants(AdamStep{});
  const StepScalars scalars{step.device, lr.device, nullptr, found.device};
  const std::vector<TensorRef> none;
  const AdamConfig config{0.9, 0.999, 1e-8, 0.0, true, true, false, false};
  cuda::adam(none, none, none, none, none, none, config, scalars, false, constants.device, nullptr);
  REQUIRE(step.get() == 8.0f);
  found.set(1.0f);
  cuda::adam(none, none, none, none, none, none, config, scalars, false, constants.device, nullptr);
  REQUIRE(step.get() == 8.0f);
}
