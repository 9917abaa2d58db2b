// The portable and AVX2+F16C CPU Adam/SGD span kernels, one thread, calls interleaved: the
// speedup of hardware fp16/bf16 conversion on its own, without torch or the op layer.
// Build against the kernels library of `make cpp-test`:
//   g++ -std=c++17 -O2 -Icsrc/kernels benchmarks/optimizer_variants.cpp \
//       build/cpp-tests/libampfuse_kernels.a -o /tmp/optimizer_variants && /tmp/optimizer_variants
#include "cpu/optimizer_variants.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::cpu;

namespace {

constexpr std::int64_t kElements = 1 << 16;  // one span of the op layer
constexpr int kRepeats = 400;

double seconds(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void report(const char* name, const std::function<void(bool)>& step) {
  std::vector<double> times[2];
  for (int i = 0; i < 10; ++i) step(i % 2);
  for (int i = 0; i < 2 * kRepeats; ++i) times[i % 2].push_back(seconds([&] { step(i % 2); }));
  for (auto& t : times) std::sort(t.begin(), t.end());
  const double us = 1e6;
  std::printf("%-34s %9.1f %9.1f %9.1f %9.1f %8.2f %7.2f\n", name, times[0][0] * us,
              times[0][kRepeats / 2] * us, times[1][0] * us, times[1][kRepeats / 2] * us,
              times[0][0] / times[1][0], times[0][kRepeats / 2] / times[1][kRepeats / 2]);
}

}  // namespace

int main() {
  if (!cpu_has_avx2_f16c()) {
    std::printf("this CPU has no AVX2+F16C\n");
    return 0;
  }
  std::printf("# %lld elements per call, one thread; us per call\n", (long long)kElements);
  std::printf("%-34s %9s %9s %9s %9s %8s %7s\n", "case", "port min", "median", "avx2 min", "median",
              "speedup", "median");
  const AdamConfig adam{0.9, 0.999, 1e-8, 0.01, true, true, false, false};
  const SgdConfig sgd{0.9, 0.0, 0.0, false, false, false};
  const std::size_t n = kElements;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const char* dname = dtype == DType::kFloat16 ? "fp16" : "bf16";
    for (bool write : {true, false}) {
      std::vector<std::uint16_t> param(n, 0x3c00), grad(n);
      for (std::size_t i = 0; i < n; ++i) grad[i] = static_cast<std::uint16_t>(0x3000 + i % 1024);
      std::vector<float> m(n, 0.0f), v(n, 0.0f), master(n, 1.0f);
      char name[64];
      // A scale of 1 leaves the grads as they were, so every call sees the same data.
      std::snprintf(name, sizeof name, "adam %s masters%s", dname, write ? " write_grad" : "");
      const AdamStep astep = make_step_constants(adam, 0.0f, 1e-4f, 1.0f);
      report(name, [&](bool use_avx2) {
        (use_avx2 ? avx2::adam : portable::adam)(param.data(), dtype, grad.data(), dtype, write,
                                                 m.data(), v.data(), nullptr, master.data(),
                                                 kElements, astep);
      });
      std::snprintf(name, sizeof name, "sgd %s masters%s", dname, write ? " write_grad" : "");
      const SgdStep sstep = make_step_constants(sgd, 1.0f, 1e-4f, 1.0f);
      report(name, [&](bool use_avx2) {
        (use_avx2 ? avx2::sgd : portable::sgd)(param.data(), dtype, grad.data(), dtype, write,
                                               m.data(), master.data(), kElements, sstep);
      });
    }
  }
}
