// The CPU LAMB span kernels (cpu_kernels.h): the two passes of lamb_math.h, eight elements at a
// time on Lanes8 with the last n % 8 elements in scalar loops, as the Adam and SGD kernels of
// optimizer_variants.h run. fp16/bf16 reach the lanes through F16C where the processor has it
// (avx2::) and through software conversions elsewhere (portable::, cloned for AVX2 so fp32 runs
// on AVX registers everywhere); both give the same bits (lamb_variants.h).
#include <algorithm>

#include "cpu_kernels.h"
#include "lamb_variants.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {
namespace {

// Squares accumulate in fp32 lanes for kFoldElements elements at most, then move into double
// lanes, so a 64K-element span's sum stays within ~1e-7 of float64 (as sum_of_squares_span).
constexpr std::int64_t kFoldElements = 128;

struct SquareSums {
  double param = 0.0;
  double update = 0.0;
};

template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
inline void lamb_moments_loop(const Param* __restrict param, Grad* __restrict grad,
                              float* __restrict exp_avg, float* __restrict exp_avg_sq,
                              const float* __restrict master, std::int64_t n,
                              const LambStep& step, SquareSums& sums) {
  float param_sq = 0.0f, update_sq = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    const float p =
        load_param_and_grad<kMaster, kWriteGrad>(param, grad, master, i, step.grad_scale, g);
    const float u = lamb_moments(g, p, exp_avg[i], exp_avg_sq[i], step);
    param_sq += p * p;
    update_sq += u * u;
  }
  sums.param += param_sq;
  sums.update += update_sq;
}

template <bool kMaster, typename Param>
inline void lamb_apply_loop(Param* __restrict param, const float* __restrict exp_avg,
                            const float* __restrict exp_avg_sq, float* __restrict master,
                            std::int64_t n, const LambStep& step, float ratio) {
  for (std::int64_t i = 0; i < n; ++i) {
    float p = kMaster ? master[i] : Element<Param>::load(param[i]);
    lamb_apply(p, exp_avg[i], exp_avg_sq[i], ratio, step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, typename Param,
          typename Grad>
inline __attribute__((always_inline)) void lamb_moments_lanes(
    const Param* param, Grad* grad, float* exp_avg, float* exp_avg_sq, const float* master,
    std::int64_t n, const LambStep& step_in, SquareSums& sums) {
  const LambStep step = step_in;  // a copy, for the reason adam_lanes gives
  const std::int64_t whole = n - n % 8;
  double param_lanes[8] = {}, update_lanes[8] = {};
  for (std::int64_t start = 0; start < whole; start += kFoldElements) {
    const std::int64_t end = std::min(whole, start + kFoldElements);
    Lanes8 param_sq, update_sq;
    for (std::int64_t i = start; i < end; i += 8) {
      Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
      if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
      const Lanes8 p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
      Lanes8 m = Lanes<float>::load(exp_avg + i), v = Lanes<float>::load(exp_avg_sq + i);
      const Lanes8 u = lamb_moments(g, p, m, v, step);
      Lanes<float>::store(exp_avg + i, m);
      Lanes<float>::store(exp_avg_sq + i, v);
      param_sq += mul(p, p);
      update_sq += mul(u, u);
    }
    for (int k = 0; k < 8; ++k) {
      param_lanes[k] += param_sq.v[k];
      update_lanes[k] += update_sq.v[k];
    }
  }
  for (int k = 0; k < 8; ++k) {
    sums.param += param_lanes[k];
    sums.update += update_lanes[k];
  }
  lamb_moments_loop<kMaster, kWriteGrad>(param + whole, grad + whole, exp_avg + whole,
                                         exp_avg_sq + whole, kMaster ? master + whole : nullptr,
                                         n - whole, step, sums);
}

template <template <typename> class Lanes, bool kMaster, typename Param>
inline __attribute__((always_inline)) void lamb_apply_lanes(Param* param, const float* exp_avg,
                                                            const float* exp_avg_sq,
                                                            float* master, std::int64_t n,
                                                            const LambStep& step_in,
                                                            float ratio) {
  const LambStep step = step_in;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
    lamb_apply(p, Lanes<float>::load(exp_avg + i), Lanes<float>::load(exp_avg_sq + i), ratio,
               step);
    if (kMaster) Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  lamb_apply_loop<kMaster>(param + whole, exp_avg + whole, exp_avg_sq + whole,
                           kMaster ? master + whole : nullptr, n - whole, step, ratio);
}

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::moments<kMaster, kWriteGrad>(param, grad, exp_avg, exp_avg_sq,
// master, n, step, sums) and Kernels::apply<kMaster>(param, exp_avg, exp_avg_sq, master, n,
// step, ratio). The span's sums are formed from zero and then added to *param_sq, *update_sq.
template <typename Kernels>
void lamb_moments_any(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                      bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                      std::int64_t n, const LambStep& step, double* param_sq,
                      double* update_sq) {
  SquareSums sums;
  with_span_types(const_cast<void*>(param), param_dtype, grad, grad_dtype, master != nullptr,
                  write_grad, [&](auto* p, auto* g, auto has_master, auto write) {
                    Kernels::template moments<has_master, write>(p, g, exp_avg, exp_avg_sq,
                                                                 master, n, step, sums);
                  });
  *param_sq += sums.param;
  *update_sq += sums.update;
}

template <typename Kernels>
void lamb_apply_any(void* param, DType param_dtype, const float* exp_avg,
                    const float* exp_avg_sq, float* master, std::int64_t n,
                    const LambStep& step, float ratio) {
  with_storage(param_dtype, param, [&](auto* p) {
    with_flag(master != nullptr, [&](auto has_master) {
      Kernels::template apply<has_master>(p, exp_avg, exp_avg_sq, master, n, step, ratio);
    });
  });
}

}  // namespace

namespace portable {
namespace {

// The 8-lane loops with software conversions, cloned for AVX2 (fp32 then runs on AVX registers)
// and the baseline (fp16/bf16 on CPUs without F16C, and every dtype off x86).
struct Kernels {
  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_CPU_CLONES static void moments(const Param* param, Grad* grad, float* exp_avg,
                                         float* exp_avg_sq, const float* master, std::int64_t n,
                                         const LambStep& step, SquareSums& sums) {
    lamb_moments_lanes<PortableLanes, kMaster, kWriteGrad>(param, grad, exp_avg, exp_avg_sq,
                                                          master, n, step, sums);
  }

  template <bool kMaster, typename Param>
  AMPFUSE_CPU_CLONES static void apply(Param* param, const float* exp_avg,
                                       const float* exp_avg_sq, float* master, std::int64_t n,
                                       const LambStep& step, float ratio) {
    lamb_apply_lanes<PortableLanes, kMaster>(param, exp_avg, exp_avg_sq, master, n, step, ratio);
  }
};

}  // namespace

void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg,
                            exp_avg_sq, master, n, step, param_sq, update_sq);
}

void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_any<Kernels>(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace avx2 {
namespace {

struct Kernels {
  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_AVX2 static void moments(const Param* param, Grad* grad, float* exp_avg,
                                   float* exp_avg_sq, const float* master, std::int64_t n,
                                   const LambStep& step, SquareSums& sums) {
    lamb_moments_lanes<F16cLanes, kMaster, kWriteGrad>(param, grad, exp_avg, exp_avg_sq, master,
                                                      n, step, sums);
  }

  template <bool kMaster, typename Param>
  AMPFUSE_AVX2 static void apply(Param* param, const float* exp_avg, const float* exp_avg_sq,
                                 float* master, std::int64_t n, const LambStep& step,
                                 float ratio) {
    lamb_apply_lanes<F16cLanes, kMaster>(param, exp_avg, exp_avg_sq, master, n, step, ratio);
  }
};

}  // namespace

void lamb_moments(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                  bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                  std::int64_t n, const LambStep& step, double* param_sq, double* update_sq) {
  lamb_moments_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg,
                            exp_avg_sq, master, n, step, param_sq, update_sq);
}

void lamb_apply(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                float* master, std::int64_t n, const LambStep& step, float ratio) {
  lamb_apply_any<Kernels>(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

}  // namespace avx2
#endif

void lamb_moments_span(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                       bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                       std::int64_t n, const LambStep& step, double* param_sq,
                       double* update_sq) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                       master, n, step, param_sq, update_sq);
    return;
  }
#endif
  portable::lamb_moments(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, exp_avg_sq,
                         master, n, step, param_sq, update_sq);
}

void lamb_apply_span(void* param, DType param_dtype, const float* exp_avg, const float* exp_avg_sq,
                     float* master, std::int64_t n, const LambStep& step, float ratio) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(param_dtype, param_dtype)) {
    avx2::lamb_apply(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
    return;
  }
#endif
  portable::lamb_apply(param, param_dtype, exp_avg, exp_avg_sq, master, n, step, ratio);
}

}  // namespace ampfuse::kernels::cpu
