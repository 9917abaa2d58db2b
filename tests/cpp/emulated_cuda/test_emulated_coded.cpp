// Adam and LAMB with 8-bit block-coded moments on CUDA (adam_coded.cu, lamb_coded.cu, through
// coded_chunk.cuh and multi_tensor_apply.cuh), run on the CPU by emulated_cuda.h:
// - Adam against the CPU's coded span (adam_coded_span), bit for bit (nans matching any nan);
// - LAMB against what lamb_coded promises: decoding the moments, running the fp32-moment CUDA
//   LAMB (lamb.cu, which the CUDA tests compare with the CPU on an H100) and coding the new
//   moments; the same ratios, params, grads, masters and codes.
// Each with fp32 masters, without, and the three master-free bf16 modes; both codes; params
// of one block, a ragged last block and one that spans two 64K chunks; a skipped step, which
// writes nothing; and LAMB in two halves (the sums, then the apply), as FSDP2 runs it.
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <vector>

#include "bf16_modes.h"
#include "coded_test_values.h"
#include "cpu/coded_moments.h"
#include "cpu/cpu_kernels.h"
#include "span_test_values.h"
#include "state_codes.h"
#include "variant_test_arrays.h"
#define cuda emulated_cuda
#include "cuda_kernels.h"
#undef cuda

using namespace ampfuse::kernels;
using namespace ampfuse::kernels::test;

namespace {

// Sizes: one whole block, a ragged last block, and two 64K chunks with a ragged block.
constexpr std::int64_t kSizes[] = {kStateBlock, 1000, 65536 + 300};
constexpr std::uint64_t kSeed = 1234;

// How one run holds its params: the param and grad dtypes and the master mode.
struct Setup {
  DType param_dtype;
  DType grad_dtype;
  MasterMode mode;
  bool fp32_masters;  // kFp32 only
  bool nonfinite_grads;
};

constexpr Setup kSetups[] = {
    {DType::kFloat32, DType::kFloat32, MasterMode::kFp32, false, false},
    {DType::kBFloat16, DType::kFloat16, MasterMode::kFp32, true, false},
    {DType::kFloat16, DType::kBFloat16, MasterMode::kFp32, false, false},
    {DType::kFloat32, DType::kFloat32, MasterMode::kFp32, false, true},
    {DType::kBFloat16, DType::kBFloat16, MasterMode::kStochastic, false, false},
    {DType::kBFloat16, DType::kFloat32, MasterMode::kKahan, false, false},
    {DType::kBFloat16, DType::kBFloat16, MasterMode::kSplit, false, false},
};

// Everything one param's step touches.
struct Param {
  std::int64_t n;
  std::int32_t id;
  Array param, grad;
  std::vector<float> master;
  std::vector<std::uint16_t> extra;  // compensations or low halves
  Coded m, v, vmax;

  Param(const Setup& s, std::int64_t n_, std::int32_t id_, StateCode code)
      : n(n_),
        id(id_),
        param(s.param_dtype, test_values(n_, 10 + id_, false)),
        grad(s.grad_dtype, test_values(n_, 20 + id_, s.nonfinite_grads)),
        master(test_values(n_, 10 + id_, false)),
        extra(static_cast<std::size_t>(n_)),
        m(test_values(n_, 30 + id_, false), code, false),
        v(squares(test_values(n_, 40 + id_, false)), code, true),
        vmax(squares(test_values(n_, 50 + id_, false)), code, true) {
    for (std::size_t i = 0; i < extra.size(); ++i) {
      // Small compensations, or low halves of any value.
      extra[i] = s.mode == MasterMode::kKahan ? static_cast<std::uint16_t>(0x3000 + i % 97)
                                              : static_cast<std::uint16_t>(i * 2654435761u >> 16);
    }
  }
  std::int64_t blocks() const { return (n + kStateBlock - 1) / kStateBlock; }
};

bool same_param(const Param& a, const Param& b) {
  return same(a.param, b.param) && same(a.grad, b.grad) && same(a.master, b.master) &&
         a.extra == b.extra && a.m == b.m && a.v == b.v && a.vmax == b.vmax;
}

// Copies of every param's state, to hold the state against after a skipped step.
std::vector<Param> snapshot(const std::vector<std::unique_ptr<Param>>& params) {
  std::vector<Param> copies;
  for (const auto& p : params) copies.push_back(*p);
  return copies;
}

bool unchanged(const std::vector<std::unique_ptr<Param>>& params,
               const std::vector<Param>& before) {
  for (std::size_t t = 0; t < params.size(); ++t) {
    if (!same_param(*params[t], before[t])) return false;
  }
  return true;
}

// Whether a step moved the param from the values it started with.
bool moved(const Param& p, DType dtype) {
  return !same(p.param, Array(dtype, test_values(p.n, 10 + p.id, false)));
}

std::vector<std::unique_ptr<Param>> make_params(const Setup& s, StateCode code) {
  std::vector<std::unique_ptr<Param>> params;
  std::int32_t id = 0;
  for (std::int64_t n : kSizes) params.push_back(std::make_unique<Param>(s, n, 3 * id++ + 1, code));
  return params;
}

// The lists the CUDA launchers take, over `params`.
struct Lists {
  std::vector<TensorRef> params, grads, masters;
  emulated_cuda::CodedMomentLists moments;
  MasterListMode master_mode;

  Lists(std::vector<std::unique_ptr<Param>>& ps, const Setup& s, StateCode code, bool amsgrad) {
    moments.code = code;
    master_mode.mode = s.mode;
    master_mode.seed = kSeed;
    const auto codes = [](Coded& c, std::int64_t n) {
      return TensorRef{c.codes.data(), n, DType::kFloat32};
    };
    const auto scales = [](Coded& c, std::int64_t blocks) {
      return TensorRef{c.scales.data(), blocks, DType::kFloat32};
    };
    for (auto& p : ps) {
      params.push_back({p->param.data(), p->n, s.param_dtype});
      grads.push_back({p->grad.data(), p->n, s.grad_dtype});
      if (s.fp32_masters) masters.push_back({p->master.data(), p->n, DType::kFloat32});
      if (s.mode == MasterMode::kKahan || s.mode == MasterMode::kSplit) {
        masters.push_back({p->extra.data(), p->n, DType::kBFloat16});
      }
      if (s.mode == MasterMode::kStochastic) master_mode.param_ids.push_back(p->id);
      moments.exp_avg_codes.push_back(codes(p->m, p->n));
      moments.exp_avg_scales.push_back(scales(p->m, p->blocks()));
      moments.exp_avg_sq_codes.push_back(codes(p->v, p->n));
      moments.exp_avg_sq_scales.push_back(scales(p->v, p->blocks()));
      if (amsgrad) {
        moments.max_exp_avg_sq_codes.push_back(codes(p->vmax, p->n));
        moments.max_exp_avg_sq_scales.push_back(scales(p->vmax, p->blocks()));
      }
    }
  }
};

// The CPU's view of a bf16 mode for one whole param (null in kFp32).
std::unique_ptr<cpu::Bf16Span> bf16_span(Param& p, const Setup& s, float steps_taken) {
  if (s.mode == MasterMode::kFp32) return nullptr;
  const bool stochastic = s.mode == MasterMode::kStochastic;
  return std::make_unique<cpu::Bf16Span>(
      cpu::Bf16Span{s.mode, stochastic ? nullptr : p.extra.data(),
                    stochastic ? rounding_key(kSeed, steps_taken, static_cast<std::uint32_t>(p.id))
                               : RoundingKey{0u, 0u},
                    0});
}

cpu::CodedMoments cpu_moments(Param& p, StateCode code, bool amsgrad) {
  return {code,
          p.m.codes.data(),
          p.m.scales.data(),
          p.v.codes.data(),
          p.v.scales.data(),
          amsgrad ? p.vmax.codes.data() : nullptr,
          amsgrad ? p.vmax.scales.data() : nullptr};
}

}  // namespace

TEST_CASE("emulated CUDA fused_adam_coded_: the CPU's coded Adam step bit for bit, and skips") {
  // Every setup with both codes; AMSGrad, grad write-back and AdamW take turns (each code meets
  // AMSGrad in some setups and not in others).
  int case_index = 0;
  for (const Setup& s : kSetups) {
    for (StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      const bool amsgrad = (case_index + case_index / 2) % 2 == 1;
      const bool write_grads = case_index % 3 != 2;
      const bool adam_w = case_index % 4 != 3;
      ++case_index;
      CAPTURE(static_cast<int>(s.param_dtype), static_cast<int>(s.grad_dtype),
              static_cast<int>(s.mode), s.fp32_masters, s.nonfinite_grads, static_cast<int>(code),
              amsgrad, write_grads, adam_w);
      auto got = make_params(s, code);
      auto want = make_params(s, code);
      Lists lists(got, s, code, amsgrad);
      const AdamConfig config{0.9, 0.999, 1e-8, 0.01, adam_w, true, amsgrad, false};
      float step = 3.0f, lr = 1e-3f, grad_scale = 512.0f, found_inf = 0.0f;
      const StepScalars scalars{&step, &lr, &grad_scale, &found_inf};
      AdamStep constants{};
      emulated_cuda::adam_coded(lists.params, lists.grads, lists.moments, lists.masters, config,
                                scalars, write_grads, &constants, nullptr, lists.master_mode);
      CHECK(step == 4.0f);
      CHECK(constants.steps_taken == 3.0f);
      for (std::size_t t = 0; t < want.size(); ++t) {
        Param& p = *want[t];
        const auto bf16 = bf16_span(p, s, constants.steps_taken);
        cpu::adam_coded_span(p.param.data(), s.param_dtype, p.grad.data(), s.grad_dtype,
                             write_grads, cpu_moments(p, code, amsgrad),
                             s.fp32_masters ? p.master.data() : nullptr, bf16.get(), p.n,
                             constants);
        CAPTURE(t);
        CHECK(same_param(*got[t], p));
        CHECK(moved(*got[t], s.param_dtype));
      }
      // A skipped step writes nothing, the step count included.
      const std::vector<Param> before = snapshot(got);
      found_inf = 1.0f;
      emulated_cuda::adam_coded(lists.params, lists.grads, lists.moments, lists.masters, config,
                                scalars, true, &constants, nullptr, lists.master_mode);
      CHECK(step == 4.0f);
      CHECK(unchanged(got, before));
    }
  }
}

namespace {

// LAMB's launch scratch for `lists`.
struct LambScratch {
  explicit LambScratch(const std::vector<TensorRef>& params)
      : chunks(emulated_cuda::lamb_scratch_chunks(params)),
        chunk_sums(static_cast<std::size_t>(2 * chunks + 1)),
        chunk_owner(static_cast<std::size_t>(chunks + 1)),
        ratios(params.size()) {}
  std::int64_t chunks;
  std::vector<float> chunk_sums;
  std::vector<std::int32_t> chunk_owner;
  std::vector<float> ratios;
};

std::vector<float> decoded(const Coded& c, std::int64_t n, StateCode code, bool second) {
  std::vector<float> out(static_cast<std::size_t>(n));
  cpu::portable::decode_moment_span(c.codes.data(), c.scales.data(), 0, n, code, second,
                                    out.data());
  return out;
}

}  // namespace

TEST_CASE("emulated CUDA fused_lamb_coded_: decode, the fp32-moment CUDA LAMB, encode") {
  const LambConfig configs[] = {{0.9, 0.999, 1e-6, 0.01, 1.0, true, true, true, false},
                                {0.9, 0.99, 1e-8, 0.01, 0.0, false, false, false, true}};
  int case_index = 0;
  for (const Setup& s : kSetups) {
    for (StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      const LambConfig& config = configs[case_index % 2];
      const bool write_grads = case_index % 3 != 0;
      ++case_index;
      CAPTURE(static_cast<int>(s.param_dtype), static_cast<int>(s.grad_dtype),
              static_cast<int>(s.mode), s.fp32_masters, s.nonfinite_grads, static_cast<int>(code),
              config.max_grad_norm, write_grads);
      auto got = make_params(s, code);
      auto want = make_params(s, code);
      Lists lists(got, s, code, false);
      float step = 3.0f, lr = 1e-3f, grad_scale = 512.0f, found_inf = 0.0f;
      const float grad_norm = 512.0f * 300.0f;
      const StepScalars scalars{&step, &lr, &grad_scale, &found_inf};
      const float* norm = config.max_grad_norm > 0.0 ? &grad_norm : nullptr;
      LambStep constants{};
      LambScratch scratch(lists.params);
      emulated_cuda::lamb_coded(lists.params, lists.grads, lists.moments, lists.masters, config,
                                scalars, norm, write_grads, &constants, scratch.chunk_sums.data(),
                                scratch.chunk_owner.data(), scratch.ratios.data(), nullptr,
                                LambPart::kBoth, nullptr, lists.master_mode);
      CHECK(step == 4.0f);

      // The reference: the same step on decoded moments through the fp32-moment launcher.
      std::vector<std::vector<float>> m, v;
      Lists ref_lists(want, s, code, false);
      std::vector<TensorRef> ms, vs;
      for (auto& p : want) {
        m.push_back(decoded(p->m, p->n, code, false));
        v.push_back(decoded(p->v, p->n, code, true));
      }
      for (std::size_t t = 0; t < want.size(); ++t) {
        ms.push_back({m[t].data(), want[t]->n, DType::kFloat32});
        vs.push_back({v[t].data(), want[t]->n, DType::kFloat32});
      }
      float ref_step = 3.0f;
      const StepScalars ref_scalars{&ref_step, &lr, &grad_scale, &found_inf};
      LambStep ref_constants{};
      LambScratch ref_scratch(ref_lists.params);
      emulated_cuda::lamb(ref_lists.params, ref_lists.grads, ms, vs, ref_lists.masters, config,
                          ref_scalars, norm, write_grads, &ref_constants,
                          ref_scratch.chunk_sums.data(), ref_scratch.chunk_owner.data(),
                          ref_scratch.ratios.data(), nullptr, LambPart::kBoth, nullptr,
                          ref_lists.master_mode);
      CHECK(ref_step == 4.0f);
      for (std::size_t t = 0; t < want.size(); ++t) {
        Param& p = *want[t];
        cpu::portable::encode_moment_span(m[t].data(), 0, p.n, code, false, p.m.codes.data(),
                                          p.m.scales.data());
        cpu::portable::encode_moment_span(v[t].data(), 0, p.n, code, true, p.v.codes.data(),
                                          p.v.scales.data());
        CAPTURE(t);
        CHECK(same(scratch.ratios[t], ref_scratch.ratios[t]));
        CHECK(same_param(*got[t], p));
        CHECK(moved(*got[t], s.param_dtype));
      }
      // A skipped step writes nothing but the scratch.
      const std::vector<Param> before = snapshot(got);
      found_inf = 1.0f;
      emulated_cuda::lamb_coded(lists.params, lists.grads, lists.moments, lists.masters, config,
                                scalars, norm, true, &constants, scratch.chunk_sums.data(),
                                scratch.chunk_owner.data(), scratch.ratios.data(), nullptr,
                                LambPart::kBoth, nullptr, lists.master_mode);
      CHECK(step == 4.0f);
      CHECK(unchanged(got, before));
    }
  }
}

TEST_CASE("emulated CUDA fused_lamb_coded_ in two halves (sums, then apply) is the one call") {
  const LambConfig config{0.9, 0.999, 1e-6, 0.01, 1.0, true, true, true, false};
  // fp32 masters, and the two bf16 modes whose rounding or low halves the apply half keys.
  for (const Setup& s : {kSetups[1], kSetups[4], kSetups[6]}) {
    for (StateCode code : {StateCode::kInt8, StateCode::kFp8}) {
      CAPTURE(static_cast<int>(s.param_dtype), static_cast<int>(s.grad_dtype),
              static_cast<int>(s.mode), s.fp32_masters, static_cast<int>(code));
      // One set steps in one call (kBoth, asked for its tensor sums too), the other in two.
      auto one = make_params(s, code);
      auto two = make_params(s, code);
      const std::vector<Param> start = snapshot(two);
      Lists a(one, s, code, false), b(two, s, code, false);
      const std::size_t n = one.size();
      float step_a = 3.0f, step_b = 3.0f, lr = 1e-3f, grad_scale = 512.0f, found_inf = 0.0f;
      const float grad_norm = 512.0f * 300.0f;
      const StepScalars scalars_a{&step_a, &lr, &grad_scale, &found_inf};
      const StepScalars scalars_b{&step_b, &lr, &grad_scale, &found_inf};
      LambStep constants_a{}, constants_b{};
      LambScratch scratch_a(a.params), scratch_b(b.params);
      std::vector<double> sums_a(2 * n, -1.0), sums_b(2 * n, -2.0);
      emulated_cuda::lamb_coded(a.params, a.grads, a.moments, a.masters, config, scalars_a,
                                &grad_norm, true, &constants_a, scratch_a.chunk_sums.data(),
                                scratch_a.chunk_owner.data(), scratch_a.ratios.data(), nullptr,
                                LambPart::kBoth, sums_a.data(), a.master_mode);
      CHECK(step_a == 4.0f);
      // The first half writes only the sums: not even the grads, and the count stays.
      emulated_cuda::lamb_coded(b.params, b.grads, b.moments, b.masters, config, scalars_b,
                                &grad_norm, true, &constants_b, scratch_b.chunk_sums.data(),
                                scratch_b.chunk_owner.data(), nullptr, nullptr, LambPart::kMoments,
                                sums_b.data(), b.master_mode);
      CHECK(step_b == 3.0f);
      CHECK(unchanged(two, start));
      for (std::size_t i = 0; i < sums_a.size(); ++i) CHECK(same(sums_a[i], sums_b[i]));
      emulated_cuda::lamb_coded(b.params, b.grads, b.moments, b.masters, config, scalars_b,
                                &grad_norm, true, &constants_b, scratch_b.chunk_sums.data(),
                                scratch_b.chunk_owner.data(), scratch_b.ratios.data(), nullptr,
                                LambPart::kApply, sums_b.data(), b.master_mode);
      CHECK(step_b == 4.0f);
      for (std::size_t t = 0; t < n; ++t) {
        CAPTURE(t);
        CHECK(same(scratch_a.ratios[t], scratch_b.ratios[t]));
        CHECK(same_param(*one[t], *two[t]));
        CHECK(moved(*two[t], s.param_dtype));
      }
    }
  }
}
