// Inputs no ampfuse kernel takes (sparse, quantized, mkldnn or nested tensors, devices
// without ampfuse kernels) reach the dispatcher's CompositeExplicitAutograd or
// AutogradNestedTensor slot instead of a CPU/CUDA kernel. These functions sit there, so
// the caller gets ampfuse's own error naming the tensor and the fix, never the
// dispatcher's "Could not run ... with arguments from the 'SparseCPU' backend".
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <string>

#include "checks.h"

namespace ampfuse::ops {

namespace refusal_detail {

inline bool starts_with(const std::string& text, const char* prefix) {
  return text.rfind(prefix, 0) == 0;
}

// The fix depends on the op's family, which its name says, so an op needs no entry here:
// fused_* ops are optimizer steps; multi_tensor_* ops act element by element, so on a
// coalesced sparse tensor's values exactly as on the tensor.
inline std::string sparse_fix(const std::string& op, bool compressed) {
  if (starts_with(op, "fused_")) {
    return "Fused optimizers update dense params from dense grads: use torch.optim.SparseAdam "
           "or torch.optim.SGD for params with sparse grads (e.g. nn.Embedding(sparse=True)), "
           "or pass grad.to_dense().";
  }
  if (!starts_with(op, "multi_tensor_")) return "Pass a dense tensor (t.to_dense()).";
  if (compressed) {
    return "Pass its values instead (t.values()): scaling, inf/nan checks and norms of a "
           "sparse tensor are those of its stored values.";
  }
  return "Coalesce it first, which sums duplicate entries (t = t.coalesce(), as torch's "
         "GradScaler does for sparse grads), then pass t._values(): scaling, inf/nan checks "
         "and norms of a coalesced sparse tensor are those of its values.";
}

}  // namespace refusal_detail

inline void check_supported(const char* op, const std::string& label, const at::Tensor& t) {
  if (!t.defined()) return;
  const std::string prefix = std::string("ampfuse.") + op + ": " + label;
  TORCH_CHECK(!t.is_sparse(), prefix,
              " is a sparse COO tensor; ampfuse ops take dense "
              "(strided) tensors. ",
              refusal_detail::sparse_fix(op, false));
  TORCH_CHECK(!t.is_sparse_csr(), prefix, " is a sparse tensor of layout ", t.layout(),
              "; ampfuse ops take dense (strided) tensors. ", refusal_detail::sparse_fix(op, true));
  TORCH_CHECK(!t.is_mkldnn(), prefix,
              " is an mkldnn tensor; ampfuse ops take dense "
              "(strided) tensors. Pass t.to_dense().");
  TORCH_CHECK(!t.is_quantized(), prefix, " is a quantized tensor (", t.scalar_type(),
              "); ampfuse ops take float32, float16 or bfloat16 tensors. Pass t.dequantize().");
  TORCH_CHECK(!t.is_nested(), prefix,
              " is a nested tensor; ampfuse ops take lists of "
              "dense tensors. Pass its components as separate tensors (t.unbind()).");
  TORCH_CHECK(t.layout() == at::kStrided, prefix, " has layout ", t.layout(),
              "; ampfuse ops take dense (strided) tensors. Pass t.to_dense().");
  const at::DeviceType type = t.device().type();
#ifdef AMPFUSE_WITH_CUDA
  const bool has_kernels = type == at::kCPU || type == at::kCUDA || type == at::kMeta;
  const char* fix = "ampfuse runs on CPU and CUDA tensors: move the tensors there.";
#else
  const bool has_kernels = type == at::kCPU || type == at::kMeta;
  const char* fix =
      "This build of ampfuse has CPU kernels only (it was built without a CUDA toolkit): move "
      "the tensors to the CPU, or rebuild ampfuse with CUDA.";
#endif
  TORCH_CHECK(has_kernels, prefix, " is on ", t.device(), ", which ampfuse has no kernels for. ",
              fix);
}

inline void refuse_unsupported_inputs(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = schema.name().substr(schema.name().find("::") + 2);
  const auto& arguments = schema.arguments();
  const auto values = torch::jit::last(*stack, arguments.size());
  for (std::size_t a = 0; a < arguments.size(); ++a) {
    const c10::IValue& value = values[a];
    const std::string& arg = arguments[a].name();
    if (value.isTensor()) {
      check_supported(name.c_str(), arg, value.toTensor());
    } else if (value.isTensorList()) {
      const auto list = value.toTensorList();
      for (std::size_t i = 0; i < list.size(); ++i) {
        check_supported(name.c_str(), arg_label(arg.c_str(), static_cast<std::int64_t>(i)),
                        list.get(i));
      }
    }
  }
  // Every tensor is of a supported kind, yet no CPU or CUDA kernel was picked: the dispatch
  // keys came from something else (a tensor subclass or mode that does not handle the op).
  TORCH_CHECK(false, "ampfuse.", name,
              ": no ampfuse kernel handles these arguments (they are "
              "not plain CPU or CUDA tensors); pass plain dense CPU or CUDA tensors.");
}

}  // namespace ampfuse::ops
