#include "checks.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace ampfuse::ops {

std::string arg_label(const char* name, std::int64_t index) {
  return index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
}

std::ostream& operator<<(std::ostream& out, const ArgLabel& label) {
  out << label.name;
  if (label.index >= 0) out << '[' << label.index << ']';
  return out;
}

namespace {

std::string dtype_name(at::ScalarType dtype) { return "torch." + c10::getDtypeNames(dtype).first; }

}  // namespace

kernels::DType kernel_dtype(const char* op, const at::Tensor& t, const ArgLabel& label) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "ampfuse.", op, ": ", label, " has dtype ", dtype_name(t.scalar_type()),
                  "; ampfuse ops take torch.float32, torch.float16 or torch.bfloat16 tensors. "
                  "Convert it first, or leave this tensor out of the call.");
  }
}

void check_scalar_tensor(const char* op, const at::Tensor& t, const ArgLabel& name,
                         at::ScalarType dtype, c10::optional<at::Device> device,
                         const char* device_owner) {
  TORCH_CHECK(t.scalar_type() == dtype, "ampfuse.", op, ": ", name, " must be a ",
              dtype_name(dtype), " tensor, got ", dtype_name(t.scalar_type()),
              ". Create it with torch.ones(1, dtype=", dtype_name(dtype), ", device=...).");
  TORCH_CHECK(t.numel() == 1, "ampfuse.", op, ": ", name,
              " must hold exactly one element, got shape ", t.sizes(), ".");
  if (device.has_value()) {
    TORCH_CHECK(t.device() == *device, "ampfuse.", op, ": ", name, " is on ", t.device(),
                " but must be on ", *device, " (the device of ", device_owner, ")", "; move ", name,
                " to ", *device, ".");
  }
}

c10::optional<at::Device> list_device(const char* op, at::TensorList list, const char* name) {
  if (list.empty()) return c10::nullopt;
  const at::Device device = list[0].device();
  for (std::size_t i = 1; i < list.size(); ++i) {
    TORCH_CHECK(list[i].device() == device, "ampfuse.", op, ": ", arg_label(name, i), " is on ",
                list[i].device(), " but ", arg_label(name, 0), " is on ", device,
                "; all tensors of one call must be on the same device (call once per device).");
  }
  return device;
}

kernels::TensorRef tensor_ref(const char* op, const at::Tensor& t, const ArgLabel& label,
                              bool mutated, std::vector<at::Tensor>& keep_alive) {
  TORCH_CHECK(t.defined(), "ampfuse.", op, ": ", label, " is an undefined tensor (None).");
  TORCH_CHECK(t.layout() == at::kStrided, "ampfuse.", op, ": ", label, " has layout ", t.layout(),
              "; only dense (strided) tensors are supported.");
  const kernels::DType dtype = kernel_dtype(op, t, label);
  // Dense means the elements fill one block of memory in some dimension order
  // (contiguous, channels_last, a transpose): element-wise kernels can then walk
  // that block flat.
  if (t.is_non_overlapping_and_dense()) {
    return {t.numel() == 0 ? nullptr : t.data_ptr(), t.numel(), dtype};
  }
  TORCH_CHECK(!mutated, "ampfuse.", op, ": ", label,
              " is not contiguous (its elements do not fill one block of memory, e.g. a "
              "strided slice), and it is written in place. Pass a contiguous tensor "
              "(.contiguous()) and copy the result back if you need the view updated.");
  keep_alive.push_back(t.contiguous());
  const at::Tensor& dense = keep_alive.back();
  return {dense.numel() == 0 ? nullptr : dense.data_ptr(), dense.numel(), dtype};
}

WrittenList::WrittenList(const char* op, at::TensorList list, const char* name,
                         std::vector<CopyBack>& copy_back)
    : list_(list) {
  for (std::size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    // Undefined and sparse tensors are left to tensor_refs, which refuses them.
    if (!t.defined() || t.layout() != at::kStrided || t.is_non_overlapping_and_dense()) continue;
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "ampfuse.", op, ": ",
                arg_label(name, static_cast<std::int64_t>(i)), " has strides ", t.strides(),
                " for shape ", t.sizes(),
                ", so several of its elements share one memory "
                "location (e.g. an expand()); it cannot be written in place. Pass a tensor with "
                "its own memory (.clone()).");
    if (staged_.empty()) staged_.assign(list.begin(), list.end());
    staged_[i] = t.contiguous();
    copy_back.push_back({t, staged_[i]});
  }
}

std::vector<kernels::TensorRef> tensor_refs(const char* op, at::TensorList list, const char* name,
                                            bool mutated, std::vector<at::Tensor>& keep_alive) {
  std::vector<kernels::TensorRef> refs;
  refs.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    refs.push_back(
        tensor_ref(op, list[i], ArgLabel{name, static_cast<std::int64_t>(i)}, mutated, keep_alive));
  }
  return refs;
}

std::vector<kernels::TensorRef> companion_refs(const char* op, at::TensorList list,
                                               const char* name, at::TensorList params,
                                               Access access, bool fp32_only, bool optional,
                                               std::vector<at::Tensor>& keep_alive,
                                               std::vector<CopyBack>* copy_back) {
  if (optional && list.empty()) return {};
  TORCH_CHECK(list.size() == params.size(), "ampfuse.", op, ": ", name, " has ", list.size(),
              " tensors but params has ", params.size(), "; pass one per param",
              optional ? " (or an empty list)." : ".");
  const bool mutated = access == Access::kWrite;
  std::vector<kernels::TensorRef> refs;
  refs.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    const ArgLabel label{name, static_cast<std::int64_t>(i)};
    TORCH_CHECK(list[i].defined(), "ampfuse.", op, ": ", label, " is an undefined tensor (None).");
    TORCH_CHECK(list[i].sizes() == params[i].sizes(), "ampfuse.", op, ": ", label, " has shape ",
                list[i].sizes(), " but ", arg_label("params", i), " has shape ", params[i].sizes(),
                ".");
    TORCH_CHECK(list[i].device() == params[i].device(), "ampfuse.", op, ": ", label, " is on ",
                list[i].device(), " but ", arg_label("params", i), " is on ", params[i].device(),
                ".");
    TORCH_CHECK(!fp32_only || list[i].scalar_type() == at::kFloat, "ampfuse.", op, ": ", label,
                " must be torch.float32 (optimizer state and masters are kept in fp32), got ",
                "torch.", c10::getDtypeNames(list[i].scalar_type()).first, ".");
    const bool same_layout = list[i].numel() <= 1 || list[i].strides() == params[i].strides();
    if (same_layout || !params[i].is_non_overlapping_and_dense()) {
      // Params reach here dense (WrittenList): a non-dense one is a caller's mistake that
      // tensor_refs refuses, and its companions need no copy first.
      refs.push_back(tensor_ref(op, list[i], label, mutated, keep_alive));
      continue;
    }
    TORCH_CHECK(access != Access::kWrite, "ampfuse.", op, ": ", label, " has strides ",
                list[i].strides(), " but ", arg_label("params", i), " has strides ",
                params[i].strides(),
                "; create it with torch.zeros_like(param) so both share "
                "one memory layout.");
    const at::Tensor copy = at::empty_like(params[i], list[i].options()).copy_(list[i]);
    keep_alive.push_back(copy);
    if (access == Access::kWriteOrCopyBack) copy_back->push_back({list[i], copy});
    refs.push_back(tensor_ref(op, copy, label, mutated, keep_alive));
  }
  return refs;
}

}  // namespace ampfuse::ops
