// multi_tensor_unscale_, multi_tensor_scale_ and multi_tensor_nonfinite_check_: validation,
// then the CPU span kernels or the CUDA launchers (csrc/kernels/scale.cu).
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_like.h>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../ops.h"
#include "checks.h"
#include "cpu_spans.h"
#include "cuda_context.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kUnscale = "multi_tensor_unscale_";
constexpr const char* kScale = "multi_tensor_scale_";
constexpr const char* kCheck = "multi_tensor_nonfinite_check_";

// The optional per-tensor overflow flags (nonfinite_kind.h): a contiguous 1-D int32 tensor
// with one element per tensor of `list`, on found_inf's device. Returns its data, or null.
std::int32_t* tensor_flags_data(const char* op, const c10::optional<at::Tensor>& tensor_flags,
                                std::size_t count, const char* list_name,
                                const at::Tensor& found_inf) {
  if (!tensor_flags.has_value() || !tensor_flags->defined()) return nullptr;
  const at::Tensor& flags = *tensor_flags;
  TORCH_CHECK(flags.scalar_type() == at::kInt && flags.dim() == 1 &&
                  flags.numel() == static_cast<std::int64_t>(count) && flags.is_contiguous(),
              "ampfuse.", op, ": tensor_flags must be a contiguous 1-D torch.int32 tensor with ",
              "one element per tensor of ", list_name, " (", count, "), got shape ",
              flags.sizes(), " and dtype torch.", c10::getDtypeNames(flags.scalar_type()).first,
              ". Create it with torch.zeros(len(", list_name, "), dtype=torch.int32, ",
              "device=...).");
  TORCH_CHECK(flags.device() == found_inf.device(), "ampfuse.", op, ": tensor_flags is on ",
              flags.device(), " but must be on ", found_inf.device(),
              " (the device of found_inf); move tensor_flags to ", found_inf.device(), ".");
  return flags.data_ptr<std::int32_t>();
}

struct UnscaleArgs {
  std::vector<kernels::TensorRef> grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;  // grads that are not dense (see WrittenList)
  std::int32_t* tensor_flags;
};

UnscaleArgs check_unscale(at::TensorList grads, const at::Tensor& found_inf,
                          const at::Tensor& inv_scale,
                          const c10::optional<at::Tensor>& tensor_flags) {
  const auto device = list_device(kUnscale, grads, "grads");
  check_scalar_tensor(kUnscale, found_inf, "found_inf", at::kFloat, device);
  check_scalar_tensor(kUnscale, inv_scale, "inv_scale", at::kFloat, device);
  UnscaleArgs args;
  const WrittenList written(kUnscale, grads, "grads", args.copy_back);
  args.grads = tensor_refs(kUnscale, written.tensors(), "grads", /*mutated=*/true,
                           args.keep_alive);
  args.tensor_flags = tensor_flags_data(kUnscale, tensor_flags, grads.size(), "grads", found_inf);
  return args;
}

struct CheckArgs {
  std::vector<kernels::TensorRef> tensors;
  std::vector<at::Tensor> keep_alive;  // contiguous copies of non-dense tensors
  std::int32_t* tensor_flags;
};

CheckArgs check_nonfinite_check(at::TensorList tensors, const at::Tensor& found_inf,
                                const c10::optional<at::Tensor>& tensor_flags) {
  const auto device = list_device(kCheck, tensors, "tensors");
  check_scalar_tensor(kCheck, found_inf, "found_inf", at::kFloat, device);
  CheckArgs args;
  args.tensors = tensor_refs(kCheck, tensors, "tensors", /*mutated=*/false, args.keep_alive);
  args.tensor_flags =
      tensor_flags_data(kCheck, tensor_flags, tensors.size(), "tensors", found_inf);
  return args;
}

struct ScaleArgs {
  std::vector<kernels::TensorRef> src;
  std::vector<kernels::TensorRef> dst;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;  // destinations that are not dense (see WrittenList)
  std::int32_t* tensor_flags;
};

ScaleArgs check_scale(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                      const at::Tensor& found_inf,
                      const c10::optional<at::Tensor>& tensor_flags) {
  TORCH_CHECK(src.size() == dst.size(), "ampfuse.", kScale, ": src has ", src.size(),
              " tensors but dst has ", dst.size(), "; pass one destination per source.");
  const auto device = list_device(kScale, src, "src");
  const auto dst_device = list_device(kScale, dst, "dst");
  TORCH_CHECK(device == dst_device, "ampfuse.", kScale, ": src is on ", *device,
              " but dst is on ", *dst_device, "; both lists must be on one device.");
  check_scalar_tensor(kScale, scale, "scale", at::kFloat, device);
  check_scalar_tensor(kScale, found_inf, "found_inf", at::kFloat, device);
  ScaleArgs args;
  const WrittenList written(kScale, dst, "dst", args.copy_back);
  const at::TensorList dense_dst = written.tensors();
  args.dst = tensor_refs(kScale, dense_dst, "dst", /*mutated=*/true, args.keep_alive);
  // Each source is read in the flat element order of its destination; a source
  // laid out differently (or not dense) is first copied into the destination's layout.
  args.src.reserve(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    const ArgLabel label{"src", static_cast<std::int64_t>(i)};
    TORCH_CHECK(src[i].sizes() == dst[i].sizes(), "ampfuse.", kScale, ": ", label,
                " has shape ", src[i].sizes(), " but ", arg_label("dst", i), " has shape ",
                dst[i].sizes(), "; each destination must match its source's shape.");
    if (src[i].numel() > 0 && src[i].storage().is_alias_of(dst[i].storage())) {
      const auto overlap = at::get_overlap_status(src[i], dst[i]);
      TORCH_CHECK(overlap == at::MemOverlapStatus::No ||
                      (overlap == at::MemOverlapStatus::Full &&
                       src[i].scalar_type() == dst[i].scalar_type()),
                  "ampfuse.", kScale, ": ", label, " and ", arg_label("dst", i),
                  " share memory without being the same tensor; use separate storage, or the "
                  "very same tensor for an in-place scale.");
    }
    const bool same_layout = src[i].is_non_overlapping_and_dense() &&
                             (src[i].numel() <= 1 || src[i].strides() == dense_dst[i].strides());
    if (same_layout) {
      args.src.push_back(tensor_ref(kScale, src[i], label, /*mutated=*/false, args.keep_alive));
      continue;
    }
    const at::Tensor copy = at::empty_like(dense_dst[i], src[i].options()).copy_(src[i]);
    args.keep_alive.push_back(copy);
    args.src.push_back(tensor_ref(kScale, copy, label, /*mutated=*/false, args.keep_alive));
  }
  args.tensor_flags = tensor_flags_data(kScale, tensor_flags, src.size(), "src", found_inf);
  return args;
}

}  // namespace

void multi_tensor_unscale_cpu(at::TensorList grads, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale,
                              const c10::optional<at::Tensor>& tensor_flags) {
  const UnscaleArgs args = check_unscale(grads, found_inf, inv_scale, tensor_flags);
  const float factor = *inv_scale.data_ptr<float>();
  const std::vector<Span> spans = split_into_spans(args.grads);
  const bool nonfinite = any_span_flagging(spans, args.tensor_flags, [&](std::size_t s) {
    const kernels::TensorRef& t = args.grads[spans[s].tensor];
    return kernels::cpu::unscale_span(element_ptr(t, spans[s].offset), t.dtype, spans[s].size,
                                      factor);
  });
  finish_copy_back(args.copy_back);
  if (nonfinite) *found_inf.data_ptr<float>() = 1.0f;
}

void multi_tensor_nonfinite_check_cpu(at::TensorList tensors, const at::Tensor& found_inf,
                                      const c10::optional<at::Tensor>& tensor_flags) {
  const CheckArgs args = check_nonfinite_check(tensors, found_inf, tensor_flags);
  float* flag = found_inf.data_ptr<float>();
  // Never cleared: with found_inf set there is nothing left to decide, unless the caller
  // asked which tensors hold the inf/nan.
  if (*flag != 0.0f && args.tensor_flags == nullptr) return;
  const std::vector<Span> spans = split_into_spans(args.tensors);
  const bool nonfinite = any_span_flagging(spans, args.tensor_flags, [&](std::size_t s) {
    const kernels::TensorRef& t = args.tensors[spans[s].tensor];
    const void* data = element_ptr(t, spans[s].offset);
    if (!kernels::cpu::nonfinite_span(data, t.dtype, spans[s].size)) return 0u;
    // Read once more, only where an inf/nan was seen, to tell which.
    return kernels::cpu::nonfinite_kinds_span(data, t.dtype, spans[s].size);
  });
  if (nonfinite) *flag = 1.0f;
}

void multi_tensor_scale_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                            const at::Tensor& found_inf,
                            const c10::optional<at::Tensor>& tensor_flags) {
  const ScaleArgs args = check_scale(src, dst, scale, found_inf, tensor_flags);
  const float factor = *scale.data_ptr<float>();
  const std::vector<Span> spans = split_into_spans(args.dst);
  const bool nonfinite = any_span_flagging(spans, args.tensor_flags, [&](std::size_t s) {
    const kernels::TensorRef& from = args.src[spans[s].tensor];
    const kernels::TensorRef& to = args.dst[spans[s].tensor];
    return kernels::cpu::scale_span(element_ptr(from, spans[s].offset), from.dtype,
                                    element_ptr(to, spans[s].offset), to.dtype, spans[s].size,
                                    factor);
  });
  finish_copy_back(args.copy_back);
  if (nonfinite) *found_inf.data_ptr<float>() = 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
void multi_tensor_unscale_cuda(at::TensorList grads, const at::Tensor& found_inf,
                               const at::Tensor& inv_scale,
                               const c10::optional<at::Tensor>& tensor_flags) {
  const UnscaleArgs args = check_unscale(grads, found_inf, inv_scale, tensor_flags);
  if (args.grads.empty()) return;
  const c10::cuda::CUDAGuard guard(found_inf.device());
  kernels::cuda::unscale(args.grads, found_inf.data_ptr<float>(), inv_scale.data_ptr<float>(),
                         args.tensor_flags, current_stream(found_inf.device()));
  finish_copy_back(args.copy_back);
}

void multi_tensor_nonfinite_check_cuda(at::TensorList tensors, const at::Tensor& found_inf,
                                       const c10::optional<at::Tensor>& tensor_flags) {
  const CheckArgs args = check_nonfinite_check(tensors, found_inf, tensor_flags);
  if (args.tensors.empty()) return;
  const c10::cuda::CUDAGuard guard(found_inf.device());
  kernels::cuda::nonfinite_check(args.tensors, found_inf.data_ptr<float>(), args.tensor_flags,
                                 current_stream(found_inf.device()));
}

void multi_tensor_scale_cuda(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                             const at::Tensor& found_inf,
                             const c10::optional<at::Tensor>& tensor_flags) {
  const ScaleArgs args = check_scale(src, dst, scale, found_inf, tensor_flags);
  if (args.dst.empty()) return;
  const c10::cuda::CUDAGuard guard(found_inf.device());
  kernels::cuda::scale(args.src, args.dst, scale.data_ptr<float>(), found_inf.data_ptr<float>(),
                       args.tensor_flags, current_stream(found_inf.device()));
  finish_copy_back(args.copy_back);
}
#endif

}  // namespace ampfuse::ops
