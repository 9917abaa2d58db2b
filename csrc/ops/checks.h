// Argument validation shared by every op: each check names the op, the argument
// and (for lists) the index, and says how to fix the call.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>
#include <c10/util/Optional.h>

#include <ostream>
#include <string>
#include <vector>

#include "../kernels/dtype.h"

namespace ampfuse::ops {

// "grads[3]" for a list element, "found_inf" for a single argument (index < 0).
std::string arg_label(const char* name, std::int64_t index = -1);

// The same label, formatted only when streamed into an error message: the per-tensor checks
// that run at every call (hundreds of tensors per optimizer step) then build no string.
struct ArgLabel {
  ArgLabel(const char* name, std::int64_t index = -1) : name(name), index(index) {}  // NOLINT
  const char* name;
  std::int64_t index;
};
std::ostream& operator<<(std::ostream& out, const ArgLabel& label);

// The kernel dtype of a float32/float16/bfloat16 tensor; any other dtype is an error.
kernels::DType kernel_dtype(const char* op, const at::Tensor& t, const ArgLabel& label);

// A one-element `dtype` tensor on `device` (the device of `device_owner`), such as
// found_inf or a scale.
void check_scalar_tensor(const char* op, const at::Tensor& t, const ArgLabel& name,
                         at::ScalarType dtype, c10::optional<at::Device> device,
                         const char* device_owner = "the tensors");

// One tensor's kernel view: checks what tensor_refs checks, for one tensor. A tensor that is
// not dense is copied into `keep_alive` (a read-only one) or refused (a `mutated` one); a dense
// one is viewed in place and not copied: copying an at::Tensor that Python also holds costs a
// Python reference count and, on release, a GIL acquire (torch ties the Python object to a
// second C++ reference), hundreds of times per optimizer step.
kernels::TensorRef tensor_ref(const char* op, const at::Tensor& t, const ArgLabel& label,
                              bool mutated, std::vector<at::Tensor>& keep_alive);

// Validates a list of floating tensors (dtype, one device) and returns kernel
// views of them. Tensors that are written (`mutated`) must already be dense
// (contiguous in some dimension order: pass WrittenList::tensors()); read-only tensors that
// are not dense are copied to a contiguous temporary kept alive in `keep_alive`.
std::vector<kernels::TensorRef> tensor_refs(const char* op, at::TensorList list, const char* name,
                                            bool mutated, std::vector<at::Tensor>& keep_alive);

// The device shared by every tensor of `list`, or nullopt for an empty list.
c10::optional<at::Device> list_device(const char* op, at::TensorList list, const char* name);

// A tensor the kernel writes through a temporary, and that temporary: after the kernel,
// `target.copy_(temporary)` gives the caller's tensor its result.
struct CopyBack {
  at::Tensor target;
  at::Tensor temporary;
};

inline void finish_copy_back(const std::vector<CopyBack>& copy_back) {
  for (const CopyBack& c : copy_back) c.target.copy_(c.temporary);
}

// A list an op writes in place, as its kernels can take it. The kernels walk each tensor's
// memory flat, so a tensor whose elements do not fill one block of memory (a strided slice
// such as torch.randn(10, 5, 2)[..., 0], which torch.optim steps like any param) is written
// through a contiguous temporary that finish_copy_back() copies into it after the kernel. A
// tensor with overlapping elements (expand()) has no single value per element and is refused.
// Dense tensors are used as they are, and the caller's list is copied only when one is not
// dense (see tensor_ref on what a copy of an at::Tensor costs). Companions of the list (grads,
// state) are then checked against tensors(): a contiguous temporary takes contiguous state.
class WrittenList {
 public:
  WrittenList(const char* op, at::TensorList list, const char* name,
              std::vector<CopyBack>& copy_back);
  at::TensorList tensors() const { return staged_.empty() ? list_ : at::TensorList(staged_); }

 private:
  at::TensorList list_;
  std::vector<at::Tensor> staged_;  // empty unless a tensor of list_ is not dense
};

// How an op uses a companion list.
enum class Access {
  kRead,             // laid out unlike its param: read from a copy in the param's layout
  kWrite,            // must share its param's memory layout (state the op owns)
  kWriteOrCopyBack,  // written; one laid out unlike its param goes through a CopyBack
};

// Validates `list` as a companion of `params` (grads, moments, masters): the same
// length (an empty list is accepted when `optional`), shapes and device. With
// `fp32_only` every tensor must be float32. See Access for the memory layout;
// kWriteOrCopyBack appends to `copy_back`.
std::vector<kernels::TensorRef> companion_refs(const char* op, at::TensorList list,
                                               const char* name, at::TensorList params,
                                               Access access, bool fp32_only, bool optional,
                                               std::vector<at::Tensor>& keep_alive,
                                               std::vector<CopyBack>* copy_back = nullptr);

}  // namespace ampfuse::ops
