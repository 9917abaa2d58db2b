// The CPU LAMB span kernels (cpu_kernels.h): the two passes of lamb_math.h, eight elements at a
// time on Lanes8 with the last n % 8 elements in scalar loops, as the Adam and SGD kernels of
// optimizer_variants.h run. fp16/bf16 reach the lanes through F16C where the processor has it
// (avx2::) and through software conversions elsewhere (portable::, cloned for AVX2 so fp32 runs
// on AVX registers everywhere); both give the same bits (lamb_variants.h).
// bf16 params of the master-free modes (master_weights "stochastic", "kahan", "split") run
// the same loops, reading and writing the param through bf16_lanes.h (and bf16_span.h for the
// last n % 8 elements).
#include <algorithm>

#include "bf16_lanes.h"
#include "bf16_span.h"
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

// Where a pass reads each element's fp32 param value and writes the updated one: the param in
// its own dtype, its fp32 master (the param then receives the master rounded), or a bf16 param
// in a master-free mode. lanes<Lanes>(i) and store_lanes<Lanes>(i, p) move elements i..i+7,
// at(i) and store_at(i, p) one. The passes are written once over these, so every way of
// holding the param adds its squares in the same order: "split", whose value is the master,
// gets master_weights=True's trust ratios bit for bit.
template <typename Param>
struct OwnParam {
  Param* param;
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE Lanes8 lanes(std::int64_t i) const { return Lanes<Param>::load(param + i); }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const { return Element<Param>::load(param[i]); }
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, Lanes8 p) const {
    Lanes<Param>::store(param + i, p);
  }
  AMPFUSE_BF16_INLINE void store_at(std::int64_t i, float p) const {
    param[i] = Element<Param>::store(p);
  }
};

template <typename Param>
struct MasterParam {
  Param* param;
  float* master;
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE Lanes8 lanes(std::int64_t i) const { return Lanes<float>::load(master + i); }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const { return master[i]; }
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, Lanes8 p) const {
    Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  AMPFUSE_BF16_INLINE void store_at(std::int64_t i, float p) const {
    master[i] = p;
    param[i] = Element<Param>::store(p);
  }
};

// A bf16 param in mode kMode: eight elements through bf16_lanes.h with the word moves of
// `Words` (PortableWords, or Avx2Words in the avx2:: loops), one through bf16_span.h.
template <MasterMode kMode, typename Words>
struct Bf16ModeParam {
  std::uint16_t* param;
  std::uint16_t* extra;  // null in kStochastic
  RoundingKey key;       // the span's chunk_key (kStochastic)
  std::uint32_t first_lo;
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE Lanes8 lanes(std::int64_t i) const {
    return Bf16ModeLanes<kMode, Words>::load(param, extra, i);
  }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const {
    return load_bf16_param<kMode>(param, extra, i);
  }
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, Lanes8 p) const {
    Bf16ModeLanes<kMode, Words>::store(p, param, extra, i, key, first_lo);
  }
  AMPFUSE_BF16_INLINE void store_at(std::int64_t i, float p) const {
    store_bf16_param<kMode>(p, param, extra, i, key, first_lo);
  }
};

template <bool kMaster, typename Param>
AMPFUSE_BF16_INLINE auto param_source(Param* param, float* master) {
  if constexpr (kMaster) {
    return MasterParam<Param>{param, master};
  } else {
    return OwnParam<Param>{param};
  }
}

template <MasterMode kMode, typename Words>
AMPFUSE_BF16_INLINE Bf16ModeParam<kMode, Words> bf16_source(std::uint16_t* param,
                                                           const Bf16Span& bf16) {
  return {param, bf16.extra, chunk_key(bf16.key, bf16.first_index),
          static_cast<std::uint32_t>(bf16.first_index)};
}

template <template <typename> class Lanes, bool kWriteGrad, typename Source, typename Grad>
inline __attribute__((always_inline)) void lamb_moments_lanes(
    const Source& param, Grad* grad, float* exp_avg, float* exp_avg_sq, std::int64_t n,
    const LambStep& step_in, SquareSums& sums) {
  const LambStep step = step_in;  // a copy, for the reason adam_lanes gives
  const std::int64_t whole = n - n % 8;
  double param_lanes[8] = {}, update_lanes[8] = {};
  for (std::int64_t start = 0; start < whole; start += kFoldElements) {
    const std::int64_t end = std::min(whole, start + kFoldElements);
    Lanes8 param_sq, update_sq;
    for (std::int64_t i = start; i < end; i += 8) {
      Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
      if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
      const Lanes8 p = param.template lanes<Lanes>(i);
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
  // The last n % 8 elements one at a time, their squares added in fp32 and then to the sums.
  float param_sq = 0.0f, update_sq = 0.0f;
  for (std::int64_t i = whole; i < n; ++i) {
    const float g = unscale_grad(Element<Grad>::load(grad[i]), step.grad_scale);
    if (kWriteGrad) grad[i] = Element<Grad>::store(g);
    const float p = param.at(i);
    const float u = lamb_moments(g, p, exp_avg[i], exp_avg_sq[i], step);
    param_sq += p * p;
    update_sq += u * u;
  }
  sums.param += param_sq;
  sums.update += update_sq;
}

template <template <typename> class Lanes, typename Source>
inline __attribute__((always_inline)) void lamb_apply_lanes(const Source& param,
                                                            const float* exp_avg,
                                                            const float* exp_avg_sq,
                                                            std::int64_t n,
                                                            const LambStep& step_in,
                                                            float ratio) {
  const LambStep step = step_in;
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    Lanes8 p = param.template lanes<Lanes>(i);
    lamb_apply(p, Lanes<float>::load(exp_avg + i), Lanes<float>::load(exp_avg_sq + i), ratio,
               step);
    param.template store_lanes<Lanes>(i, p);
  }
  for (std::int64_t i = whole; i < n; ++i) {
    float p = param.at(i);
    lamb_apply(p, exp_avg[i], exp_avg_sq[i], ratio, step);
    param.store_at(i, p);
  }
}

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::moments<kWriteGrad>(source, grad, exp_avg, exp_avg_sq, n, step,
// sums) and Kernels::apply(source, exp_avg, exp_avg_sq, n, step, ratio). The span's sums are
// formed from zero and then added to *param_sq, *update_sq.
template <typename Kernels>
void lamb_moments_any(const void* param, DType param_dtype, void* grad, DType grad_dtype,
                      bool write_grad, float* exp_avg, float* exp_avg_sq, const float* master,
                      std::int64_t n, const LambStep& step, double* param_sq,
                      double* update_sq) {
  SquareSums sums;
  // The first pass only reads the param and the master.
  with_span_types(const_cast<void*>(param), param_dtype, grad, grad_dtype, master != nullptr,
                  write_grad, [&](auto* p, auto* g, auto has_master, auto write) {
                    Kernels::template moments<write>(
                        param_source<has_master>(p, const_cast<float*>(master)), g, exp_avg,
                        exp_avg_sq, n, step, sums);
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
      Kernels::apply(param_source<has_master>(p, master), exp_avg, exp_avg_sq, n, step, ratio);
    });
  });
}

}  // namespace

namespace portable {
namespace {

// The 8-lane loops with software conversions, cloned for AVX2 (fp32 then runs on AVX registers)
// and the baseline (fp16/bf16 on CPUs without F16C, and every dtype off x86).
struct Kernels {
  template <bool kWriteGrad, typename Source, typename Grad>
  AMPFUSE_CPU_CLONES static void moments(Source param, Grad* grad, float* exp_avg,
                                         float* exp_avg_sq, std::int64_t n, const LambStep& step,
                                         SquareSums& sums) {
    lamb_moments_lanes<PortableLanes, kWriteGrad>(param, grad, exp_avg, exp_avg_sq, n, step,
                                                  sums);
  }

  template <typename Source>
  AMPFUSE_CPU_CLONES static void apply(Source param, const float* exp_avg,
                                       const float* exp_avg_sq, std::int64_t n,
                                       const LambStep& step, float ratio) {
    lamb_apply_lanes<PortableLanes>(param, exp_avg, exp_avg_sq, n, step, ratio);
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
  template <bool kWriteGrad, typename Source, typename Grad>
  AMPFUSE_AVX2 static void moments(Source param, Grad* grad, float* exp_avg, float* exp_avg_sq,
                                   std::int64_t n, const LambStep& step, SquareSums& sums) {
    lamb_moments_lanes<F16cLanes, kWriteGrad>(param, grad, exp_avg, exp_avg_sq, n, step, sums);
  }

  template <typename Source>
  AMPFUSE_AVX2 static void apply(Source param, const float* exp_avg, const float* exp_avg_sq,
                                 std::int64_t n, const LambStep& step, float ratio) {
    lamb_apply_lanes<F16cLanes>(param, exp_avg, exp_avg_sq, n, step, ratio);
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

// The bf16 modes run the avx2:: loops (F16C grads, AVX2 word moves) where the processor has
// AVX2 and F16C, whatever the grad dtype, and the portable ones elsewhere. Lanes add in the same
// order in both variants, so "split" matches master_weights=True whichever variant that one ran.
void lamb_moments_bf16_span(const std::uint16_t* param, const Bf16Span& bf16, void* grad,
                            DType grad_dtype, bool write_grad, float* exp_avg,
                            float* exp_avg_sq, std::int64_t n, const LambStep& step,
                            double* param_sq, double* update_sq) {
  SquareSums sums;
  auto* bits = const_cast<std::uint16_t*>(param);
  with_bf16_span_types(bf16, grad, grad_dtype, write_grad, [&](auto mode, auto* g, auto write) {
    constexpr MasterMode kMode = decltype(mode)::value;
#ifdef AMPFUSE_HAVE_AVX2_PATH
    if (cpu_has_avx2_f16c()) {
      avx2::Kernels::moments<write>(bf16_source<kMode, Avx2Words>(bits, bf16), g, exp_avg,
                                    exp_avg_sq, n, step, sums);
      return;
    }
#endif
    portable::Kernels::moments<write>(bf16_source<kMode, PortableWords>(bits, bf16), g, exp_avg,
                                      exp_avg_sq, n, step, sums);
  });
  *param_sq += sums.param;
  *update_sq += sums.update;
}

void lamb_apply_bf16_span(std::uint16_t* param, const Bf16Span& bf16, const float* exp_avg,
                          const float* exp_avg_sq, std::int64_t n, const LambStep& step,
                          float ratio) {
  with_bf16_mode(bf16.mode, [&](auto mode) {
    constexpr MasterMode kMode = decltype(mode)::value;
#ifdef AMPFUSE_HAVE_AVX2_PATH
    if (cpu_has_avx2_f16c()) {
      avx2::Kernels::apply(bf16_source<kMode, Avx2Words>(param, bf16), exp_avg, exp_avg_sq, n,
                           step, ratio);
      return;
    }
#endif
    portable::Kernels::apply(bf16_source<kMode, PortableWords>(param, bf16), exp_avg,
                             exp_avg_sq, n, step, ratio);
  });
}

}  // namespace ampfuse::kernels::cpu
