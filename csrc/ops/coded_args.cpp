// The checks of coded_args.h, with one wording for both coded-moment ops.
#include "coded_args.h"

#include <c10/core/ScalarType.h>

#include <string>
#include <utility>

#include "checks.h"

namespace ampfuse::ops {
namespace {

// The dtype of a moment's codes: int8 codes the first moment in a signed byte and the second
// in an unsigned one; fp8 codes both as e4m3.
at::ScalarType code_dtype(kernels::StateCode code, bool second) {
  if (code == kernels::StateCode::kFp8) return at::kFloat8_e4m3fn;
  return second ? at::kByte : at::kChar;
}

std::string dtype_name(at::ScalarType dtype) { return "torch." + c10::getDtypeNames(dtype).first; }

}  // namespace

kernels::StateCode parse_state_dtype(const char* op, c10::string_view name, const char* fp32_op) {
  if (name == "int8") return kernels::StateCode::kInt8;
  if (name == "fp8") return kernels::StateCode::kFp8;
  TORCH_CHECK(false, "ampfuse.", op, ": state_dtype='", std::string(name),
              "' is not one of 'int8', 'fp8' (fp32 moments are stepped by ", fp32_op, ").");
}

void check_coded_moment(const char* op, at::TensorList params, at::TensorList codes,
                        const char* codes_name, at::TensorList scales, const char* scales_name,
                        kernels::StateCode code, bool second, bool optional,
                        std::vector<kernels::TensorRef>& codes_out,
                        std::vector<kernels::TensorRef>& scales_out) {
  if (optional && codes.empty() && scales.empty()) return;
  for (const auto& [list, name] : {std::pair{codes, codes_name}, std::pair{scales, scales_name}}) {
    TORCH_CHECK(list.size() == params.size(), "ampfuse.", op, ": ", name, " has ", list.size(),
                " tensors but params has ", params.size(), "; pass one tensor per param",
                optional ? " (or empty lists)." : ".");
  }
  const at::ScalarType expected = code_dtype(code, second);
  const char* state_dtype = code == kernels::StateCode::kFp8 ? "fp8" : "int8";
  const std::int64_t block = kernels::kStateBlock;
  codes_out.reserve(params.size());
  scales_out.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& c = codes[i];
    const at::Tensor& s = scales[i];
    const at::Tensor& p = params[i];
    const ArgLabel label{codes_name, static_cast<std::int64_t>(i)};
    const ArgLabel scale_label{scales_name, static_cast<std::int64_t>(i)};
    const ArgLabel param_label{"params", static_cast<std::int64_t>(i)};
    TORCH_CHECK(c.defined(), "ampfuse.", op, ": ", label, " is an undefined tensor.");
    TORCH_CHECK(c.scalar_type() == expected, "ampfuse.", op, ": ", label, " must be ",
                dtype_name(expected), " with state_dtype='", state_dtype, "', got ",
                dtype_name(c.scalar_type()),
                "; create it with torch.zeros_like(param, dtype=", dtype_name(expected), ").");
    TORCH_CHECK(c.sizes() == p.sizes(), "ampfuse.", op, ": ", label, " has shape ", c.sizes(),
                " but ", param_label, " has shape ", p.sizes(),
                "; codes are shaped and laid "
                "out like their param (torch.zeros_like(param, dtype=",
                dtype_name(expected), ")).");
    TORCH_CHECK(c.device() == p.device(), "ampfuse.", op, ": ", label, " is on ", c.device(),
                " but ", param_label, " is on ", p.device(), "; move it to its param's device.");
    // A tensor of at most one element has no layout to share.
    TORCH_CHECK(c.layout() == at::kStrided && c.is_non_overlapping_and_dense() &&
                    (c.numel() <= 1 || c.strides() == p.strides()),
                "ampfuse.", op, ": ", label, " has strides ", c.strides(), " but ", param_label,
                " has strides ", p.strides(),
                "; create it with torch.zeros_like(param, dtype=", dtype_name(expected),
                ") so both share one memory layout.");
    const std::int64_t blocks = (p.numel() + block - 1) / block;
    TORCH_CHECK(s.defined() && s.scalar_type() == at::kFloat, "ampfuse.", op, ": ", scale_label,
                " must be torch.float32 (one absmax per block), got ",
                s.defined() ? dtype_name(s.scalar_type()) : std::string("None"), ".");
    TORCH_CHECK(s.device() == p.device(), "ampfuse.", op, ": ", scale_label, " is on ", s.device(),
                " but ", param_label, " is on ", p.device(), "; move it to its param's device.");
    TORCH_CHECK(s.dim() == 1 && s.numel() == blocks && s.is_contiguous(), "ampfuse.", op, ": ",
                scale_label, " must be a contiguous 1-D tensor of ", blocks,
                " elements, one per "
                "block of ",
                block, " of ", param_label, "'s ", p.numel(), " (ceil(numel / ", block,
                ") = ", blocks, " elements), got shape ", s.sizes(), " and strides ", s.strides(),
                "; create it with torch.zeros(", blocks, ", dtype=torch.float32).");
    codes_out.push_back(
        {c.numel() == 0 ? nullptr : c.data_ptr(), c.numel(), kernels::DType::kFloat32});
    scales_out.push_back(
        {s.numel() == 0 ? nullptr : s.data_ptr(), s.numel(), kernels::DType::kFloat32});
  }
}

}  // namespace ampfuse::ops
