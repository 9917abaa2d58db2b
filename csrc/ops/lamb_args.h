// What fused_lamb_ and fused_lamb_coded_ (lamb.cpp, lamb_coded.cpp) check and read alike: the
// part spellings, tensor_sums and the hyperparameters.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <string>

#include "../kernels/lamb_math.h"
#include "optimizer_args.h"

namespace ampfuse::ops {

inline kernels::LambPart parse_lamb_part(const char* op, c10::string_view part) {
  if (part == "both") return kernels::LambPart::kBoth;
  if (part == "moments") return kernels::LambPart::kMoments;
  if (part == "apply") return kernels::LambPart::kApply;
  TORCH_CHECK(false, "ampfuse.", op, ": part='", std::string(part),
              "' is not one of 'both', 'moments', 'apply'.");
}

// tensor_sums: what the first half leaves for the second (each tensor's sums of squares of its
// param and its update), a contiguous float64 [n, 2] tensor on the params' device; required by
// the halves, optional (an extra output) for kBoth.
inline double* lamb_sums_ptr(const char* op, const c10::optional<at::Tensor>& sums,
                             kernels::LambPart part, std::size_t n, const at::Device& device) {
  const bool given = sums.has_value() && sums->defined();
  TORCH_CHECK(given || part == kernels::LambPart::kBoth, "ampfuse.", op,
              ": part='moments' and part='apply' pass each tensor's sums of squares through "
              "tensor_sums; give a torch.float64 tensor of shape (",
              n, ", 2).");
  if (!given) return nullptr;
  const at::Tensor& t = *sums;
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 2 &&
                  t.size(0) == static_cast<std::int64_t>(n) && t.size(1) == 2 &&
                  t.is_contiguous() && t.device() == device,
              "ampfuse.", op,
              ": tensor_sums must be a contiguous torch.float64 tensor of "
              "shape (",
              n, ", 2) on ", device, ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device(), ".");
  return t.data_ptr<double>();
}

inline void check_lamb_hyperparameters(const char* op, double beta1, double beta2, double eps,
                                       double weight_decay, double max_grad_norm) {
  check_moment_hyperparameters(op, beta1, beta2, eps);
  TORCH_CHECK(weight_decay >= 0.0, "ampfuse.", op, ": weight_decay must be >= 0, got ",
              weight_decay, ".");
  TORCH_CHECK(max_grad_norm >= 0.0 && std::isfinite(max_grad_norm), "ampfuse.", op,
              ": max_grad_norm must be a finite number >= 0 (0 turns clipping off), got ",
              max_grad_norm, ".");
}

}  // namespace ampfuse::ops
