// The CPU NovoGrad span kernels (cpu_kernels.h): the two passes of novograd_math.h. The L2
// reduction and the update run eight elements at a time on Lanes8 with the last n % 8 elements
// in scalar loops, as the LAMB kernels do; fp16/bf16 reach the lanes through F16C where the
// processor has it (avx2::) and through software conversions elsewhere (portable::, cloned for
// AVX2); both give the same bits (novograd_variants.h). The max reduction is a scalar loop: it
// has to let a NaN through, which a vector max does not, and it is the rarely used norm.
#include <algorithm>

#include "cpu_kernels.h"
#include "novograd_variants.h"
#include "optimizer_variants.h"

namespace ampfuse::kernels::cpu {
namespace {

// Squares accumulate in fp32 lanes for kFoldElements elements at most, then move into double
// lanes, as the LAMB kernels and sum_of_squares_span do.
constexpr std::int64_t kFoldElements = 128;

template <typename Grad>
inline double sum_of_unscaled_squares_loop(const Grad* __restrict grad, std::int64_t n,
                                           float grad_scale) {
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = unscale_grad(Element<Grad>::load(grad[i]), grad_scale);
    sum += mul(g, g);
  }
  return sum;
}

template <template <typename> class Lanes, typename Grad>
inline __attribute__((always_inline)) double sum_of_unscaled_squares_lanes(const Grad* grad,
                                                                           std::int64_t n,
                                                                           float grad_scale) {
  const std::int64_t whole = n - n % 8;
  double lanes[8] = {};
  for (std::int64_t start = 0; start < whole; start += kFoldElements) {
    const std::int64_t end = std::min(whole, start + kFoldElements);
    Lanes8 squares;
    for (std::int64_t i = start; i < end; i += 8) {
      const Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), grad_scale);
      squares += mul(g, g);
    }
    for (int k = 0; k < 8; ++k) lanes[k] += squares.v[k];
  }
  double sum = 0.0;
  for (int k = 0; k < 8; ++k) sum += lanes[k];
  return sum + sum_of_unscaled_squares_loop(grad + whole, n - whole, grad_scale);
}

template <typename Grad>
double max_unscaled_abs(const Grad* grad, std::int64_t n, float grad_scale) {
  float running = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    running = max_abs_step(running, unscale_grad(Element<Grad>::load(grad[i]), grad_scale));
  }
  return running;
}

template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
inline void novograd_apply_loop(Param* __restrict param, Grad* __restrict grad,
                                float* __restrict exp_avg, float* __restrict master, std::int64_t n,
                                const NovoGradStep& step, float denom) {
  for (std::int64_t i = 0; i < n; ++i) {
    float g;
    float p = load_param_and_grad<kMaster, kWriteGrad>(param, grad, master, i, step.grad_scale, g);
    novograd_update(p, g, exp_avg[i], denom, step);
    if (kMaster) master[i] = p;
    param[i] = Element<Param>::store(p);
  }
}

template <template <typename> class Lanes, bool kMaster, bool kWriteGrad, typename Param,
          typename Grad>
inline __attribute__((always_inline)) void novograd_apply_lanes(Param* param, Grad* grad,
                                                                float* exp_avg, float* master,
                                                                std::int64_t n,
                                                                const NovoGradStep& step_in,
                                                                float denom) {
  const NovoGradStep step = step_in;  // a copy, for the reason adam_lanes gives
  const std::int64_t whole = n - n % 8;
  for (std::int64_t i = 0; i < whole; i += 8) {
    const Lanes8 g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
    if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
    Lanes8 p = kMaster ? Lanes<float>::load(master + i) : Lanes<Param>::load(param + i);
    Lanes8 m = Lanes<float>::load(exp_avg + i);
    novograd_update(p, g, m, denom, step);
    Lanes<float>::store(exp_avg + i, m);
    if (kMaster) Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  novograd_apply_loop<kMaster, kWriteGrad>(param + whole, grad + whole, exp_avg + whole,
                                           kMaster ? master + whole : nullptr, n - whole, step,
                                           denom);
}

// The runtime-dtype entry points of one implementation, whose typed loops are the static
// member templates Kernels::sum_of_squares<Grad>(grad, n, grad_scale) and
// Kernels::apply<kMaster, kWriteGrad>(param, grad, exp_avg, master, n, step, denom).
template <typename Kernels>
double novograd_norm_any(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                         bool max_norm) {
  return with_storage(grad_dtype, const_cast<void*>(grad), [&](auto* g) {
    return max_norm ? max_unscaled_abs(g, n, grad_scale)
                    : Kernels::sum_of_squares(g, n, grad_scale);
  });
}

template <typename Kernels>
void novograd_apply_any(void* param, DType param_dtype, void* grad, DType grad_dtype,
                        bool write_grad, float* exp_avg, float* master, std::int64_t n,
                        const NovoGradStep& step, float denom) {
  with_span_types(param, param_dtype, grad, grad_dtype, master != nullptr, write_grad,
                  [&](auto* p, auto* g, auto has_master, auto write) {
                    Kernels::template apply<has_master, write>(p, g, exp_avg, master, n, step,
                                                               denom);
                  });
}

}  // namespace

namespace portable {
namespace {

// The 8-lane loops with software conversions, cloned for AVX2 (fp32 then runs on AVX registers)
// and the baseline (fp16/bf16 on CPUs without F16C, and every dtype off x86).
struct Kernels {
  template <typename Grad>
  AMPFUSE_CPU_CLONES static double sum_of_squares(const Grad* grad, std::int64_t n,
                                                  float grad_scale) {
    return sum_of_unscaled_squares_lanes<PortableLanes>(grad, n, grad_scale);
  }

  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_CPU_CLONES static void apply(Param* param, Grad* grad, float* exp_avg, float* master,
                                       std::int64_t n, const NovoGradStep& step, float denom) {
    novograd_apply_lanes<PortableLanes, kMaster, kWriteGrad>(param, grad, exp_avg, master, n, step,
                                                             denom);
  }
};

}  // namespace

double novograd_norm(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                     bool max_norm) {
  return novograd_norm_any<Kernels>(grad, grad_dtype, n, grad_scale, max_norm);
}

void novograd_apply(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                    float* exp_avg, float* master, std::int64_t n, const NovoGradStep& step,
                    float denom) {
  novograd_apply_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, master, n,
                              step, denom);
}

}  // namespace portable

#ifdef AMPFUSE_HAVE_AVX2_PATH
namespace avx2 {
namespace {

struct Kernels {
  template <typename Grad>
  AMPFUSE_AVX2 static double sum_of_squares(const Grad* grad, std::int64_t n, float grad_scale) {
    return sum_of_unscaled_squares_lanes<F16cLanes>(grad, n, grad_scale);
  }

  template <bool kMaster, bool kWriteGrad, typename Param, typename Grad>
  AMPFUSE_AVX2 static void apply(Param* param, Grad* grad, float* exp_avg, float* master,
                                 std::int64_t n, const NovoGradStep& step, float denom) {
    novograd_apply_lanes<F16cLanes, kMaster, kWriteGrad>(param, grad, exp_avg, master, n, step,
                                                         denom);
  }
};

}  // namespace

double novograd_norm(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                     bool max_norm) {
  return novograd_norm_any<Kernels>(grad, grad_dtype, n, grad_scale, max_norm);
}

void novograd_apply(void* param, DType param_dtype, void* grad, DType grad_dtype, bool write_grad,
                    float* exp_avg, float* master, std::int64_t n, const NovoGradStep& step,
                    float denom) {
  novograd_apply_any<Kernels>(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, master, n,
                              step, denom);
}

}  // namespace avx2
#endif

double novograd_norm_span(const void* grad, DType grad_dtype, std::int64_t n, float grad_scale,
                          bool max_norm) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(grad_dtype, grad_dtype)) {
    return avx2::novograd_norm(grad, grad_dtype, n, grad_scale, max_norm);
  }
#endif
  return portable::novograd_norm(grad, grad_dtype, n, grad_scale, max_norm);
}

void novograd_apply_span(void* param, DType param_dtype, void* grad, DType grad_dtype,
                         bool write_grad, float* exp_avg, float* master, std::int64_t n,
                         const NovoGradStep& step, float denom) {
#ifdef AMPFUSE_HAVE_AVX2_PATH
  if (use_avx2(param_dtype, grad_dtype)) {
    avx2::novograd_apply(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, master, n, step,
                         denom);
    return;
  }
#endif
  portable::novograd_apply(param, param_dtype, grad, grad_dtype, write_grad, exp_avg, master, n,
                           step, denom);
}

}  // namespace ampfuse::kernels::cpu
