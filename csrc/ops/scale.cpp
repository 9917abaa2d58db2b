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
              "one element per tensor of ", list_name, " (", count, "), got shape ", flags.sizes(),
              " and dtype torch.", c10::getDtypeNames(flags.scalar_type()).first,
              ". Create it with torch.zeros(len(", list_name, "), dtype=torch.int32, ",
              "device=...).");
  TORCH_CHECK(flags.device() == found_inf.device(), "ampfuse.", op, ": tensor_flags is on ",
              flags.device(), " but must be on ", found_inf.device(),
              " (the device of found_inf); move tensor_flags to ", found_inf.device(), ".");
  return flags.data_ptr<std::int32_t>();
}

// multi_tensor_unscale_ on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
void multi_tensor_unscale_(at::TensorList grads, const at::Tensor& found_inf,
                           const at::Tensor& inv_scale,
                           const c10::optional<at::Tensor>& tensor_flags) {
  const auto device = list_device(kUnscale, grads, "grads");
  check_scalar_tensor(kUnscale, found_inf, "found_inf", at::kFloat, device);
  check_scalar_tensor(kUnscale, inv_scale, "inv_scale", at::kFloat, device);
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;  // grads that are not dense (see WrittenList)
  const WrittenList written(kUnscale, grads, "grads", copy_back);
  const std::vector<kernels::TensorRef> refs =
      tensor_refs(kUnscale, written.tensors(), "grads", /*mutated=*/true, keep_alive);
  std::int32_t* flags = tensor_flags_data(kUnscale, tensor_flags, grads.size(), "grads", found_inf);
  if constexpr (kDevice == at::kCPU) {
    const float factor = *inv_scale.data_ptr<float>();
    const std::vector<Span> spans = split_into_spans(refs);
    const bool nonfinite = any_span_flagging(spans, flags, [&](std::size_t s) {
      const kernels::TensorRef& t = refs[spans[s].tensor];
      return kernels::cpu::unscale_span(element_ptr(t, spans[s].offset), t.dtype, spans[s].size,
                                        factor);
    });
    finish_copy_back(copy_back);
    if (nonfinite) *found_inf.data_ptr<float>() = 1.0f;
  } else {
#ifdef AMPFUSE_WITH_CUDA
    if (refs.empty()) return;
    const c10::cuda::CUDAGuard guard(found_inf.device());
    kernels::cuda::unscale(refs, found_inf.data_ptr<float>(), inv_scale.data_ptr<float>(), flags,
                           current_stream(found_inf.device()));
    finish_copy_back(copy_back);
#endif
  }
}

// multi_tensor_nonfinite_check_ on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
void multi_tensor_nonfinite_check_(at::TensorList tensors, const at::Tensor& found_inf,
                                   const c10::optional<at::Tensor>& tensor_flags) {
  const auto device = list_device(kCheck, tensors, "tensors");
  check_scalar_tensor(kCheck, found_inf, "found_inf", at::kFloat, device);
  std::vector<at::Tensor> keep_alive;  // contiguous copies of non-dense tensors
  const std::vector<kernels::TensorRef> refs =
      tensor_refs(kCheck, tensors, "tensors", /*mutated=*/false, keep_alive);
  std::int32_t* flags =
      tensor_flags_data(kCheck, tensor_flags, tensors.size(), "tensors", found_inf);
  if constexpr (kDevice == at::kCPU) {
    float* flag = found_inf.data_ptr<float>();
    // Never cleared: with found_inf set there is nothing left to decide, unless the caller
    // asked which tensors hold the inf/nan.
    if (*flag != 0.0f && flags == nullptr) return;
    const std::vector<Span> spans = split_into_spans(refs);
    const bool nonfinite = any_span_flagging(spans, flags, [&](std::size_t s) {
      const kernels::TensorRef& t = refs[spans[s].tensor];
      const void* data = element_ptr(t, spans[s].offset);
      if (!kernels::cpu::nonfinite_span(data, t.dtype, spans[s].size)) return 0u;
      // Read once more, only where an inf/nan was seen, to tell which.
      return kernels::cpu::nonfinite_kinds_span(data, t.dtype, spans[s].size);
    });
    if (nonfinite) *flag = 1.0f;
  } else {
#ifdef AMPFUSE_WITH_CUDA
    if (refs.empty()) return;
    const c10::cuda::CUDAGuard guard(found_inf.device());
    kernels::cuda::nonfinite_check(refs, found_inf.data_ptr<float>(), flags,
                                   current_stream(found_inf.device()));
#endif
  }
}

// multi_tensor_scale_ on kDevice (see ../ops.h).
template <c10::DeviceType kDevice>
void multi_tensor_scale_(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                         const at::Tensor& found_inf,
                         const c10::optional<at::Tensor>& tensor_flags) {
  TORCH_CHECK(src.size() == dst.size(), "ampfuse.", kScale, ": src has ", src.size(),
              " tensors but dst has ", dst.size(), "; pass one destination per source.");
  const auto device = list_device(kScale, src, "src");
  const auto dst_device = list_device(kScale, dst, "dst");
  TORCH_CHECK(device == dst_device, "ampfuse.", kScale, ": src is on ", *device, " but dst is on ",
              *dst_device, "; both lists must be on one device.");
  check_scalar_tensor(kScale, scale, "scale", at::kFloat, device);
  check_scalar_tensor(kScale, found_inf, "found_inf", at::kFloat, device);
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;  // destinations that are not dense (see WrittenList)
  const WrittenList written(kScale, dst, "dst", copy_back);
  const at::TensorList dense_dst = written.tensors();
  const std::vector<kernels::TensorRef> dst_refs =
      tensor_refs(kScale, dense_dst, "dst", /*mutated=*/true, keep_alive);
  // Each source is read in the flat element order of its destination; a source
  // laid out differently (or not dense) is first copied into the destination's layout.
  std::vector<kernels::TensorRef> src_refs;
  src_refs.reserve(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    const ArgLabel label{"src", static_cast<std::int64_t>(i)};
    TORCH_CHECK(src[i].sizes() == dst[i].sizes(), "ampfuse.", kScale, ": ", label, " has shape ",
                src[i].sizes(), " but ", arg_label("dst", i), " has shape ", dst[i].sizes(),
                "; each destination must match its source's shape.");
    if (src[i].numel() > 0 && src[i].storage().is_alias_of(dst[i].storage())) {
      const auto overlap = at::get_overlap_status(src[i], dst[i]);
      TORCH_CHECK(
          overlap == at::MemOverlapStatus::No || (overlap == at::MemOverlapStatus::Full &&
                                                  src[i].scalar_type() == dst[i].scalar_type()),
          "ampfuse.", kScale, ": ", label, " and ", arg_label("dst", i),
          " share memory without being the same tensor; use separate storage, or the "
          "very same tensor for an in-place scale.");
    }
    const bool same_layout = src[i].is_non_overlapping_and_dense() &&
                             (src[i].numel() <= 1 || src[i].strides() == dense_dst[i].strides());
    if (same_layout) {
      src_refs.push_back(tensor_ref(kScale, src[i], label, /*mutated=*/false, keep_alive));
      continue;
    }
    const at::Tensor copy = at::empty_like(dense_dst[i], src[i].options()).copy_(src[i]);
    keep_alive.push_back(copy);
    src_refs.push_back(tensor_ref(kScale, copy, label, /*mutated=*/false, keep_alive));
  }
  std::int32_t* flags = tensor_flags_data(kScale, tensor_flags, src.size(), "src", found_inf);
  if constexpr (kDevice == at::kCPU) {
    const float factor = *scale.data_ptr<float>();
    const std::vector<Span> spans = split_into_spans(dst_refs);
    const bool nonfinite = any_span_flagging(spans, flags, [&](std::size_t s) {
      const kernels::TensorRef& from = src_refs[spans[s].tensor];
      const kernels::TensorRef& to = dst_refs[spans[s].tensor];
      return kernels::cpu::scale_span(element_ptr(from, spans[s].offset), from.dtype,
                                      element_ptr(to, spans[s].offset), to.dtype, spans[s].size,
                                      factor);
    });
    finish_copy_back(copy_back);
    if (nonfinite) *found_inf.data_ptr<float>() = 1.0f;
  } else {
#ifdef AMPFUSE_WITH_CUDA
    if (dst_refs.empty()) return;
    const c10::cuda::CUDAGuard guard(found_inf.device());
    kernels::cuda::scale(src_refs, dst_refs, scale.data_ptr<float>(), found_inf.data_ptr<float>(),
                         flags, current_stream(found_inf.device()));
    finish_copy_back(copy_back);
#endif
  }
}

}  // namespace

OpKernels multi_tensor_unscale_kernels() { return AMPFUSE_KERNELS(multi_tensor_unscale_); }

OpKernels multi_tensor_nonfinite_check_kernels() {
  return AMPFUSE_KERNELS(multi_tensor_nonfinite_check_);
}

OpKernels multi_tensor_scale_kernels() { return AMPFUSE_KERNELS(multi_tensor_scale_); }

}  // namespace ampfuse::ops
