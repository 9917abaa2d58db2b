// The LAMB span loops (lamb_math.h's two passes) over lanes of any width, written once for the
// fp32-state kernels (lamb_kernels.cpp: eight lanes portable and AVX2, lamb_kernels_avx512.cpp:
// sixteen) and the 8-bit coded ones (lamb_coded_lanes.inc), which differ only in where the
// moments live (a Moments holder, as adam_lanes takes one) and where the param lives (a Source).
//
// Elementwise, a lane computes the bits the scalar code computes, whatever the width. The sums
// of squares behind the trust ratio are another matter: they are added in a fixed order, eight
// fp32 lanes (lane k holds the elements i with i % 8 == k) folded into double lanes every
// kFoldElements elements, and every width keeps that order (LaneOrderSums), so the trust ratio,
// and hence every param, is the same bits on every processor.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../lamb_math.h"
#include "../state_codes.h"
#include "bf16_lanes.h"
#include "bf16_span.h"
#include "half_convert.h"
#include "lanes8.h"

namespace ampfuse::kernels::cpu {

// Squares accumulate in fp32 lanes for kFoldElements elements at most, then move into double
// lanes, so a 64K-element span's sum stays within ~1e-7 of float64 (as sum_of_squares_span).
// The loops tell their moment holder where each fold starts; a coded holder starts its blocks
// there, so a block must hold whole folds.
constexpr std::int64_t kFoldElements = 128;
static_assert(kStateBlock % kFoldElements == 0, "a coded block holds whole folds");

struct SquareSums {
  double param = 0.0;
  double update = 0.0;
};

// The sums of squares of a span in the order of eight fp32 lanes, from lanes of any width: a
// sixteen-lane vector adds its low eight lanes and then its high eight, which is what two
// eight-lane iterations add.
struct LaneOrderSums {
  Lanes8 param_sq, update_sq;  // this fold's sums; lane k: the elements i % 8 == k
  double param_lanes[8] = {}, update_lanes[8] = {};

  template <int W>
  AMPFUSE_BF16_INLINE void add(LanesN<W> p, LanesN<W> u) {
    const LanesN<W> pp = mul(p, p), uu = mul(u, u);
    if constexpr (W == 8) {
      param_sq += pp;
      update_sq += uu;
    } else {
      static_assert(W == 16, "LAMB's lanes are eight or sixteen wide");
      param_sq += Lanes8(__builtin_shufflevector(pp.v, pp.v, 0, 1, 2, 3, 4, 5, 6, 7));
      param_sq += Lanes8(__builtin_shufflevector(pp.v, pp.v, 8, 9, 10, 11, 12, 13, 14, 15));
      update_sq += Lanes8(__builtin_shufflevector(uu.v, uu.v, 0, 1, 2, 3, 4, 5, 6, 7));
      update_sq += Lanes8(__builtin_shufflevector(uu.v, uu.v, 8, 9, 10, 11, 12, 13, 14, 15));
    }
  }
  // One element that an eight-lane loop would have added in lane k.
  AMPFUSE_BF16_INLINE void add_lane(int k, float p, float u) {
    param_sq.v[k] += p * p;
    update_sq.v[k] += u * u;
  }
  // The fold's fp32 sums into the double lanes. A fold with nothing added adds zeros: no change.
  AMPFUSE_BF16_INLINE void fold() {
    for (int k = 0; k < 8; ++k) {
      param_lanes[k] += param_sq.v[k];
      update_lanes[k] += update_sq.v[k];
    }
    param_sq = Lanes8();
    update_sq = Lanes8();
  }
  AMPFUSE_BF16_INLINE void finish(SquareSums& sums) const {
    for (int k = 0; k < 8; ++k) {
      sums.param += param_lanes[k];
      sums.update += update_lanes[k];
    }
  }
};

// Where a pass reads each element's fp32 param value and writes the updated one: the param in
// its own dtype, its fp32 master (the param then receives the master rounded), or a bf16 param
// in a master-free mode. lanes<Lanes>(i) and store_lanes<Lanes>(i, p) move one vector of
// elements from i (the width of Lanes, or of the Words policy for a bf16 mode), at(i) and
// store_at(i, p) one element. The passes are written once over these, so every way of holding
// the param adds its squares in the same order: "split", whose value is the master, gets
// master_weights=True's trust ratios bit for bit.
template <typename Param>
struct OwnParam {
  Param* param;
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE auto lanes(std::int64_t i) const {
    return Lanes<Param>::load(param + i);
  }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const { return Element<Param>::load(param[i]); }
  template <template <typename> class Lanes, typename L>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, L p) const {
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
  AMPFUSE_BF16_INLINE auto lanes(std::int64_t i) const {
    return Lanes<float>::load(master + i);
  }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const { return master[i]; }
  template <template <typename> class Lanes, typename L>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, L p) const {
    Lanes<float>::store(master + i, p);
    Lanes<Param>::store(param + i, p);
  }
  AMPFUSE_BF16_INLINE void store_at(std::int64_t i, float p) const {
    master[i] = p;
    param[i] = Element<Param>::store(p);
  }
};

// A bf16 param in mode kMode: a vector through bf16_lanes.h with the word moves of `Words`
// (PortableWords, Avx2Words or Avx512Words, whose width must be the loop's), one element through
// bf16_span.h.
template <MasterMode kMode, typename Words>
struct Bf16ModeParam {
  std::uint16_t* param;
  std::uint16_t* extra;  // null in kStochastic
  RoundingKey key;       // the span's chunk_key (kStochastic)
  std::uint32_t first_lo;
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE typename Words::Lanes lanes(std::int64_t i) const {
    return Bf16ModeLanes<kMode, Words>::load(param, extra, i);
  }
  AMPFUSE_BF16_INLINE float at(std::int64_t i) const {
    return load_bf16_param<kMode>(param, extra, i);
  }
  template <template <typename> class Lanes>
  AMPFUSE_BF16_INLINE void store_lanes(std::int64_t i, typename Words::Lanes p) const {
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

// The fp32 moments of elements [i, n), for the loops' scalar ends.
struct LambMomentPointers {
  float* exp_avg;
  float* exp_avg_sq;
};

// fp32 moment arrays as the loops' Moments holder. A holder loads and stores a vector of both
// moments at element i; is told when the loop enters the fold that starts at `start` and leaves
// the one that ends at `end` (the coded holder starts and codes its blocks there); hands the
// scalar end of the loop fp32 arrays for elements [i, n) and is told when that end is done.
struct FloatLambMoments {
  float* exp_avg;
  float* exp_avg_sq;

  template <template <typename> class Lanes, typename L>
  AMPFUSE_BF16_INLINE void load(std::int64_t i, L& m, L& v) const {
    m = Lanes<float>::load(exp_avg + i);
    v = Lanes<float>::load(exp_avg_sq + i);
  }
  template <template <typename> class Lanes, typename L>
  AMPFUSE_BF16_INLINE void store(std::int64_t i, L m, L v) const {
    Lanes<float>::store(exp_avg + i, m);
    Lanes<float>::store(exp_avg_sq + i, v);
  }
  AMPFUSE_BF16_INLINE void enter(std::int64_t /*start*/) const {}
  AMPFUSE_BF16_INLINE void leave(std::int64_t /*end*/) const {}
  LambMomentPointers scalar_tail(std::int64_t i, std::int64_t /*n*/) const {
    return {exp_avg + i, exp_avg_sq + i};
  }
  void after_scalar_tail(std::int64_t /*i*/, std::int64_t /*n*/) const {}
};

// The first pass's work on the vector of elements from i, which the second pass of the coded
// step repeats: the grad unscaled (and stored back with kWriteGrad), the moments updated through
// the holder. `p` receives the param's value; the update is returned.
template <template <typename> class Lanes, bool kWriteGrad, typename L, typename Source,
          typename Grad, typename Moments>
AMPFUSE_BF16_INLINE L update_lanes(const Source& param, Grad* grad, Moments& moments,
                                   std::int64_t i, const LambStep& step, L& p) {
  L g = unscale_grad(Lanes<Grad>::load(grad + i), step.grad_scale);
  if (kWriteGrad) Lanes<Grad>::store(grad + i, g);
  p = param.template lanes<Lanes>(i);
  L m, v;
  moments.template load<Lanes>(i, m, v);
  const L u = lamb_moments(g, p, m, v, step);
  moments.template store<Lanes>(i, m, v);
  return u;
}

// The same for element i, whose moments are m and v.
template <bool kWriteGrad, typename Source, typename Grad>
AMPFUSE_BF16_INLINE float update_element(const Source& param, Grad* grad, std::int64_t i, float& m,
                                         float& v, const LambStep& step, float& p) {
  const float g = unscale_grad(Element<Grad>::load(grad[i]), step.grad_scale);
  if (kWriteGrad) grad[i] = Element<Grad>::store(g);
  p = param.at(i);
  return lamb_moments(g, p, m, v, step);
}

// The first pass over a span of n elements: unscales (and with kWriteGrad stores) the grads,
// updates the moments, and adds the squares of the params and of the updates to `sums`. The
// vector loop runs over whole folds; the elements after the last whole vector run one at a time,
// those below n - n % 8 added in the lanes an eight-lane loop would have used, the last n % 8 in
// fp32 scalars added to the sums after the lanes.
template <template <typename> class Lanes, bool kWriteGrad, typename Source, typename Grad,
          typename Moments>
inline __attribute__((always_inline)) void lamb_moments_lanes(const Source& param, Grad* grad,
                                                              Moments& moments, std::int64_t n,
                                                              const LambStep& step_in,
                                                              SquareSums& sums) {
  const LambStep step = step_in;  // a copy, for the reason adam_lanes gives
  using L = decltype(Lanes<float>::load(static_cast<const float*>(nullptr)));
  constexpr int kWidth = L::kWidth;
  static_assert(kFoldElements % kWidth == 0, "a fold holds whole vectors");
  const std::int64_t whole8 = n - n % 8;
  const std::int64_t wide_end = whole8 - whole8 % kWidth;
  LaneOrderSums order;
  for (std::int64_t start = 0; start < wide_end; start += kFoldElements) {
    const std::int64_t end = std::min(wide_end, start + kFoldElements);
    moments.enter(start);
    for (std::int64_t i = start; i < end; i += kWidth) {
      L p;
      const L u = update_lanes<Lanes, kWriteGrad>(param, grad, moments, i, step, p);
      order.add(p, u);
    }
    if (end % kFoldElements == 0) order.fold();  // else the fold goes on below
    moments.leave(end);
  }
  const LambMomentPointers tail = moments.scalar_tail(wide_end, n);
  float param_sq = 0.0f, update_sq = 0.0f;
  for (std::int64_t i = wide_end; i < n; ++i) {
    float p;
    const float u = update_element<kWriteGrad>(param, grad, i, tail.exp_avg[i - wide_end],
                                               tail.exp_avg_sq[i - wide_end], step, p);
    if (i < whole8) {
      order.add_lane(static_cast<int>(i % 8), p, u);
    } else {
      param_sq += p * p;
      update_sq += u * u;
    }
  }
  order.fold();
  order.finish(sums);
  sums.param += param_sq;
  sums.update += update_sq;
  moments.after_scalar_tail(wide_end, n);
}

// The second pass over fp32 moments the first pass stored.
template <template <typename> class Lanes, typename Source>
inline __attribute__((always_inline)) void lamb_apply_lanes(const Source& param,
                                                            const float* exp_avg,
                                                            const float* exp_avg_sq, std::int64_t n,
                                                            const LambStep& step_in, float ratio) {
  const LambStep step = step_in;
  using L = decltype(Lanes<float>::load(static_cast<const float*>(nullptr)));
  constexpr int kWidth = L::kWidth;
  const std::int64_t whole = n - n % kWidth;
  for (std::int64_t i = 0; i < whole; i += kWidth) {
    L p = param.template lanes<Lanes>(i);
    lamb_apply(p, Lanes<float>::load(exp_avg + i), Lanes<float>::load(exp_avg_sq + i), ratio, step);
    param.template store_lanes<Lanes>(i, p);
  }
  for (std::int64_t i = whole; i < n; ++i) {
    float p = param.at(i);
    lamb_apply(p, exp_avg[i], exp_avg_sq[i], ratio, step);
    param.store_at(i, p);
  }
}

// Both halves of the second pass for moments that the first pass could not store (8-bit codes,
// lamb_coded_lanes.inc): the first pass's moment update again from the same moments, grads and
// params (so the same bits), then the param step with the update that gave, which is the
// lamb_direction() that lamb_apply_lanes would form from the stored moments (lamb_apply_update).
template <template <typename> class Lanes, bool kWriteGrad, typename Source, typename Grad,
          typename Moments>
inline __attribute__((always_inline)) void lamb_step_lanes(const Source& param, Grad* grad,
                                                           Moments& moments, std::int64_t n,
                                                           const LambStep& step_in, float ratio) {
  const LambStep step = step_in;
  using L = decltype(Lanes<float>::load(static_cast<const float*>(nullptr)));
  constexpr int kWidth = L::kWidth;
  const std::int64_t whole = n - n % kWidth;
  for (std::int64_t start = 0; start < whole; start += kFoldElements) {
    const std::int64_t end = std::min(whole, start + kFoldElements);
    moments.enter(start);
    for (std::int64_t i = start; i < end; i += kWidth) {
      L p;
      const L u = update_lanes<Lanes, kWriteGrad>(param, grad, moments, i, step, p);
      lamb_apply_update(p, u, ratio);
      param.template store_lanes<Lanes>(i, p);
    }
    moments.leave(end);
  }
  const LambMomentPointers tail = moments.scalar_tail(whole, n);
  for (std::int64_t i = whole; i < n; ++i) {
    float p;
    const float u = update_element<kWriteGrad>(param, grad, i, tail.exp_avg[i - whole],
                                               tail.exp_avg_sq[i - whole], step, p);
    lamb_apply_update(p, u, ratio);
    param.store_at(i, p);
  }
  moments.after_scalar_tail(whole, n);
}

}  // namespace ampfuse::kernels::cpu
