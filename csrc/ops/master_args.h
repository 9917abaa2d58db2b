// The master_params list of fused_adam_, fused_sgd_, fused_adagrad_, fused_lamb_ and
// fused_novograd_ under each master_mode (see kernels/bf16_modes.h): its checks, and what the
// CPU spans need to run a bf16 mode.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/bf16_modes.h"
#include "../kernels/cpu/cpu_kernels.h"
#include "checks.h"
#include "cpu_spans.h"

namespace ampfuse::ops {

// master_mode's spellings, indexed by kernels::MasterMode.
inline constexpr const char* kMasterModeNames[] = {"fp32", "stochastic", "kahan", "split"};

struct MasterArgs {
  kernels::MasterListMode how;
  // fp32 masters (kFp32; empty for none), kahan compensations or split low halves (as bf16
  // bits), or nothing (kStochastic).
  std::vector<kernels::TensorRef> list;

  bool is_bf16_mode() const { return how.mode != kernels::MasterMode::kFp32; }

  // A span's bf16 arguments (bf16 modes only); `steps_taken` is the step count before the
  // update, as the step constants carry it.
  kernels::cpu::Bf16Span span(const Span& s, float steps_taken) const {
    const bool stochastic = how.mode == kernels::MasterMode::kStochastic;
    auto* extra =
        stochastic ? nullptr : static_cast<std::uint16_t*>(element_ptr(list[s.tensor], s.offset));
    const kernels::RoundingKey key =
        stochastic ? kernels::rounding_key(how.seed, steps_taken,
                                           static_cast<std::uint32_t>(how.param_ids[s.tensor]))
                   : kernels::RoundingKey{0u, 0u};
    return {how.mode, extra, key, s.offset};
  }
};

inline kernels::MasterMode parse_master_mode(const char* op, c10::string_view name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kMasterModeNames[i]) return static_cast<kernels::MasterMode>(i);
  }
  TORCH_CHECK(false, "ampfuse.", op, ": master_mode='", std::string(name),
              "' is not one of 'fp32', 'stochastic', 'kahan', 'split'.");
}

// split's int16 low halves as the kernels take them: 2-byte bit patterns, which the kernels
// address as bf16-sized elements. companion_refs' checks for a written companion (shape, device,
// the param's memory layout), without reinterpreting each tensor as bf16 first: a view() per
// tensor was a dispatcher call and a TensorImpl per param per step, which made split's host
// time 1.3x True's on many small params (benchmarks/profile_split.py).
inline std::vector<kernels::TensorRef> low_half_refs(const char* op, at::TensorList lows,
                                                     at::TensorList params) {
  std::vector<kernels::TensorRef> refs;
  refs.reserve(lows.size());
  for (std::size_t i = 0; i < lows.size(); ++i) {
    const at::Tensor& t = lows[i];
    const std::string label = arg_label("master_params", static_cast<std::int64_t>(i));
    TORCH_CHECK(t.sizes() == params[i].sizes(), "ampfuse.", op, ": ", label, " has shape ",
                t.sizes(), " but ", arg_label("params", i), " has shape ", params[i].sizes(), ".");
    TORCH_CHECK(t.device() == params[i].device(), "ampfuse.", op, ": ", label, " is on ",
                t.device(), " but ", arg_label("params", i), " is on ", params[i].device(), ".");
    TORCH_CHECK(t.layout() == at::kStrided && t.is_non_overlapping_and_dense() &&
                    (t.numel() <= 1 || t.strides() == params[i].strides()),
                "ampfuse.", op, ": ", label, " has strides ", t.strides(), " but ",
                arg_label("params", i), " has strides ", params[i].strides(),
                "; create it with torch.zeros_like(param, dtype=torch.int16) so both share one "
                "memory layout.");
    refs.push_back({t.numel() == 0 ? nullptr : t.data_ptr(), t.numel(), kernels::DType::kBFloat16});
  }
  return refs;
}

// Validates master_params, param_ids and seed for `master_mode`. kFp32 keeps the contract the
// ops always had (fp32 masters, or an empty list). The bf16 modes take bf16 params only:
// kahan one bf16 compensation per param, split one int16 low half per param (each shaped and
// laid out like its param), stochastic no list but one param id in [0, 2^31) per param.
inline MasterArgs master_args(const char* op, c10::string_view master_mode, at::TensorList params,
                              at::TensorList master_params, at::IntArrayRef param_ids,
                              std::int64_t seed, std::vector<at::Tensor>& keep_alive) {
  MasterArgs m;
  const kernels::MasterMode mode = parse_master_mode(op, master_mode);
  m.how.mode = mode;
  m.how.seed = static_cast<std::uint64_t>(seed);
  const char* name = kMasterModeNames[static_cast<int>(mode)];
  TORCH_CHECK(mode == kernels::MasterMode::kStochastic || param_ids.empty(), "ampfuse.", op,
              ": param_ids key stochastic rounding; pass them with master_mode='stochastic' only "
              "(got ",
              param_ids.size(), " with master_mode='", name, "').");
  if (!m.is_bf16_mode()) {
    m.list = companion_refs(op, master_params, "master_params", params, Access::kWrite,
                            /*fp32_only=*/true, /*optional=*/true, keep_alive);
    return m;
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].scalar_type() == at::kBFloat16, "ampfuse.", op, ": master_mode='", name,
                "' updates torch.bfloat16 params, but ", arg_label("params", i), " is torch.",
                c10::getDtypeNames(params[i].scalar_type()).first,
                ". Step it in a call with master_mode='fp32' (with or without fp32 masters).");
  }
  if (mode == kernels::MasterMode::kStochastic) {
    TORCH_CHECK(master_params.empty(), "ampfuse.", op,
                ": master_mode='stochastic' keeps no "
                "state besides the param; pass master_params=[] (got ",
                master_params.size(), " tensors).");
    TORCH_CHECK(param_ids.size() == params.size(), "ampfuse.", op,
                ": master_mode='stochastic' "
                "needs one param id per param (",
                params.size(), "), got ", param_ids.size(), ".");
    for (std::size_t i = 0; i < param_ids.size(); ++i) {
      TORCH_CHECK(param_ids[i] >= 0 && param_ids[i] <= INT32_MAX, "ampfuse.", op, ": ",
                  arg_label("param_ids", i), " is ", param_ids[i], "; ids must be in [0, 2^31).");
      m.how.param_ids.push_back(static_cast<std::int32_t>(param_ids[i]));
    }
    return m;
  }
  const bool split = mode == kernels::MasterMode::kSplit;
  const at::ScalarType expected = split ? at::kShort : at::kBFloat16;
  TORCH_CHECK(master_params.size() == params.size(), "ampfuse.", op, ": master_mode='", name,
              "' needs one ", split ? "torch.int16 low half" : "torch.bfloat16 compensation",
              " per param in master_params (", params.size(), "), got ", master_params.size(), ".");
  for (std::size_t i = 0; i < master_params.size(); ++i) {
    const at::Tensor& t = master_params[i];
    TORCH_CHECK(
        t.defined() && t.scalar_type() == expected, "ampfuse.", op, ": ",
        arg_label("master_params", i), " must be torch.", c10::getDtypeNames(expected).first,
        " with master_mode='", name, "', got ",
        t.defined() ? "torch." + c10::getDtypeNames(t.scalar_type()).first : std::string("None"),
        ".");
  }
  m.list = split ? low_half_refs(op, master_params, params)
                 : companion_refs(op, master_params, "master_params", params, Access::kWrite,
                                  /*fp32_only=*/false, /*optional=*/false, keep_alive);
  return m;
}

}  // namespace ampfuse::ops
