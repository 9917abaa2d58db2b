// fp8_cast_amax and fp8_update_scales_: the element work around an FP8 GEMM. Arithmetic in
// csrc/kernels/fp8_math.h; the CPU loops in csrc/kernels/cpu/fp8_kernels.cpp and the CUDA
// kernels in csrc/kernels/fp8_cast.cu.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/cpu/fp8_kernels.h"
#include "../kernels/fp8_cuda.h"
#include "../ops.h"
#include "checks.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "fp8_args.h"
#include "refusals.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kCast = "fp8_cast_amax";
constexpr const char* kUpdate = "fp8_update_scales_";

struct UpdateArgs {
  std::vector<kernels::Fp8ScaleState> states;
  float margin_factor;
  bool use_max;
};

// Refuses two state tensors that share memory (the same amax twice, a history under a scale):
// the CUDA kernel updates every state at once, one block each, so shared memory would be a
// race there where the CPU's one-after-another loop gave an order-dependent answer.
void check_states_apart(at::TensorList amaxes, at::TensorList histories, at::TensorList scales,
                        at::TensorList scale_invs) {
  struct Extent {
    std::uintptr_t first;
    std::uintptr_t end;
    const char* list;
    std::size_t index;
  };
  std::vector<Extent> extents;
  extents.reserve(4 * amaxes.size());
  const auto add = [&](at::TensorList list, const char* name) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto first = reinterpret_cast<std::uintptr_t>(list[i].data_ptr());
      extents.push_back({first, first + list[i].numel() * sizeof(float), name, i});
    }
  };
  add(amaxes, "amaxes");
  add(histories, "amax_histories");
  add(scales, "scales");
  add(scale_invs, "scale_invs");
  // Stable: a tie keeps the lists' order, so the message names them as they were passed.
  std::stable_sort(extents.begin(), extents.end(),
                   [](const Extent& a, const Extent& b) { return a.first < b.first; });
  for (std::size_t i = 1; i < extents.size(); ++i) {
    const Extent& before = extents[i - 1];
    const Extent& after = extents[i];
    TORCH_CHECK(after.first >= before.end, "ampfuse.", kUpdate, ": ", before.list, "[",
                before.index, "] and ", after.list, "[", after.index,
                "] share memory; every FP8 "
                "tensor needs its own amax, amax_history, scale and scale_inv (tensors of their "
                "own, e.g. torch.zeros(1) each, not views of one another).");
  }
}

UpdateArgs prepare_update(at::TensorList amaxes, at::TensorList histories, at::TensorList scales,
                          at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                          std::int64_t margin, const std::string& amax_compute,
                          const c10::optional<at::Tensor>& found_inf) {
  const std::size_t n = amaxes.size();
  TORCH_CHECK(histories.size() == n && scales.size() == n && scale_invs.size() == n &&
                  fp8_maxes.size() == n,
              "ampfuse.", kUpdate,
              ": amaxes, amax_histories, scales, scale_invs and fp8_maxes "
              "must have one entry per FP8 tensor; got ",
              n, ", ", histories.size(), ", ", scales.size(), ", ", scale_invs.size(), " and ",
              fp8_maxes.size(), ".");
  TORCH_CHECK(amax_compute == "max" || amax_compute == "most_recent", "ampfuse.", kUpdate,
              ": amax_compute must be \"max\" (the largest amax of the history) or "
              "\"most_recent\" (this step's), got \"",
              amax_compute, "\".");
  TORCH_CHECK(margin >= 0 && margin <= 64, "ampfuse.", kUpdate,
              ": margin must be between 0 "
              "and 64 (the scale is divided by 2**margin), got ",
              margin, ".");
  const c10::optional<at::Device> device = list_device(kUpdate, amaxes, "amaxes");
  if (found_inf.has_value()) {
    check_scalar_tensor(kUpdate, *found_inf, "found_inf", at::kFloat, device, "amaxes");
  }
  UpdateArgs args{{}, std::ldexp(1.0f, static_cast<int>(margin)), amax_compute == "max"};
  args.states.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto index = static_cast<std::int64_t>(i);
    check_scalar_tensor(kUpdate, amaxes[i], ArgLabel{"amaxes", index}, at::kFloat, device,
                        "amaxes[0]");
    check_scalar_tensor(kUpdate, scales[i], ArgLabel{"scales", index}, at::kFloat, device,
                        "amaxes[0]");
    check_scalar_tensor(kUpdate, scale_invs[i], ArgLabel{"scale_invs", index}, at::kFloat, device,
                        "amaxes[0]");
    const at::Tensor& history = histories[i];
    const ArgLabel label{"amax_histories", index};
    TORCH_CHECK(history.scalar_type() == at::kFloat && history.dim() == 1 && history.numel() >= 1 &&
                    history.is_contiguous(),
                "ampfuse.", kUpdate, ": ", label,
                " must be a contiguous 1-D torch.float32 "
                "tensor of amax_history_len >= 1 entries, got dtype ",
                history.scalar_type(), " and shape ", history.sizes(), ".");
    TORCH_CHECK(history.device() == *device, "ampfuse.", kUpdate, ": ", label, " is on ",
                history.device(), " but amaxes[0] is on ", *device,
                "; keep an FP8 tensor's "
                "whole state on one device.");
    const double fp8_max = fp8_maxes[i];
    TORCH_CHECK(fp8_max == 448.0 || fp8_max == 57344.0, "ampfuse.", kUpdate, ": fp8_maxes[", i,
                "] is ", fp8_max,
                "; it must be the largest value of the tensor's format, 448 "
                "(float8_e4m3fn) or 57344 (float8_e5m2).");
    args.states.push_back({amaxes[i].data_ptr<float>(), history.data_ptr<float>(), history.numel(),
                           scales[i].data_ptr<float>(), scale_invs[i].data_ptr<float>(),
                           static_cast<float>(fp8_max)});
  }
  check_states_apart(amaxes, histories, scales, scale_invs);
  return args;
}

// fp8_cast_amax on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
at::Tensor fp8_cast_amax(const at::Tensor& input, const at::Tensor& scale, const at::Tensor& amax,
                         at::ScalarType dtype) {
  TORCH_CHECK(input.layout() == at::kStrided, "ampfuse.", kCast, ": input has layout ",
              input.layout(), "; pass a dense tensor (t.to_dense()).");
  const kernels::DType src_dtype = kernel_dtype(kCast, input, ArgLabel{"input"});
  const kernels::Fp8Format format = fp8_format(kCast, dtype, "dtype");
  check_scalar_tensor(kCast, scale, "scale", at::kFloat, input.device(), "input");
  check_scalar_tensor(kCast, amax, "amax", at::kFloat, input.device(), "input");
  // The fp8 result has the input's shape and is contiguous: the GEMM wants K-contiguous rows.
  const at::Tensor src = input.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(dtype));
  if constexpr (kDevice == at::kCPU) {
    const float scale_value = *scale.data_ptr<float>();
    const std::vector<kernels::TensorRef> list{{src.data_ptr(), src.numel(), src_dtype}};
    const std::vector<Span> spans = split_into_spans(list);
    auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
    std::atomic<std::uint32_t> largest{0};
    for_each_span(spans, [&](std::size_t s) {
      const Span& span = spans[s];
      const std::uint32_t bits =
          kernels::cpu::fp8_cast_amax_span(element_ptr(list[0], span.offset), src_dtype,
                                           dst + span.offset, span.size, scale_value, format);
      std::uint32_t seen = largest.load(std::memory_order_relaxed);
      while (bits > seen && !largest.compare_exchange_weak(seen, bits)) {
      }
    });
    // Fold into the amax already there (several casts of one step accumulate), with nan
    // winning.
    float* amax_ptr = amax.data_ptr<float>();
    const std::uint32_t folded = std::max(kernels::abs_bits(*amax_ptr), largest.load());
    *amax_ptr = __builtin_bit_cast(float, folded);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    kernels::cuda::fp8_cast_amax(
        {src.data_ptr(), src.numel(), src_dtype}, static_cast<std::uint8_t*>(out.data_ptr()),
        scale.data_ptr<float>(), amax.data_ptr<float>(), format, current_stream(input.device()));
#endif
  }
  return out;
}

// fp8_update_scales_ on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
void fp8_update_scales_(at::TensorList amaxes, at::TensorList amax_histories, at::TensorList scales,
                        at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                        std::int64_t margin, c10::string_view amax_compute,
                        const c10::optional<at::Tensor>& found_inf) {
  const UpdateArgs args = prepare_update(amaxes, amax_histories, scales, scale_invs, fp8_maxes,
                                         margin, std::string(amax_compute), found_inf);
  if constexpr (kDevice == at::kCPU) {
    const bool skip = found_inf.has_value() && *found_inf->data_ptr<float>() != 0.0f;
    for (const kernels::Fp8ScaleState& state : args.states) {
      kernels::update_fp8_scale(state, args.margin_factor, args.use_max, skip);
    }
  } else {
#ifdef AMPFUSE_WITH_CUDA
    if (args.states.empty()) return;
    const c10::cuda::CUDAGuard guard(amaxes[0].device());
    kernels::cuda::fp8_update_scales(args.states, args.margin_factor, args.use_max,
                                     found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr,
                                     current_stream(amaxes[0].device()));
#endif
  }
}

// fp8_update_scales_ for arguments no CPU or CUDA kernel takes (CompositeExplicitAutograd).
void fp8_update_scales_fallback(at::TensorList amaxes, at::TensorList amax_histories,
                                at::TensorList scales, at::TensorList scale_invs,
                                at::ArrayRef<double> fp8_maxes, std::int64_t margin,
                                c10::string_view amax_compute,
                                const c10::optional<at::Tensor>& found_inf) {
  // An empty list has no tensor to pick a backend: the arguments are still checked, and
  // nothing is updated.
  if (amaxes.empty() && amax_histories.empty() && scales.empty() && scale_invs.empty()) {
    prepare_update(amaxes, amax_histories, scales, scale_invs, fp8_maxes, margin,
                   std::string(amax_compute), found_inf);
    return;
  }
  for (const auto& [name, list] : {std::pair{"amaxes", amaxes},
                                   {"amax_histories", amax_histories},
                                   {"scales", scales},
                                   {"scale_invs", scale_invs}}) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      check_supported(kUpdate, arg_label(name, static_cast<std::int64_t>(i)), list[i]);
    }
  }
  if (found_inf.has_value()) check_supported(kUpdate, "found_inf", *found_inf);
  TORCH_CHECK(false, "ampfuse.", kUpdate,
              ": no ampfuse kernel handles these arguments (they "
              "are not plain CPU or CUDA tensors); pass plain dense CPU or CUDA tensors.");
}

}  // namespace

OpKernels fp8_cast_amax_kernels() { return AMPFUSE_KERNELS(fp8_cast_amax); }

OpKernels fp8_update_scales_kernels() {
  OpKernels kernels = AMPFUSE_KERNELS(fp8_update_scales_);
  kernels.fallback.emplace(&fp8_update_scales_fallback);
  return kernels;
}

}  // namespace ampfuse::ops
