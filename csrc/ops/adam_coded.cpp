// fused_adam_coded_: fused_adam_ with Adam's moments held as 8-bit block codes
// (kernels/state_codes.h): validation, then the CPU span kernel or the CUDA launcher
// (csrc/kernels/adam_coded.cu).
#include <string>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../kernels/state_codes.h"
#include "../ops.h"
#include "checks.h"
#include "coded_spans.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "master_args.h"
#include "optimizer_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kAdamCoded = "fused_adam_coded_";
using kernels::kStateBlock;
using kernels::StateCode;

struct AdamCodedArgs {
  std::vector<kernels::TensorRef> params, grads;
  kernels::cuda::CodedMomentLists moments;
  MasterArgs masters;
  kernels::AdamConfig config;
  kernels::StepScalars scalars;
  bool write_grads;
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

StateCode parse_state_dtype(c10::string_view name) {
  if (name == "int8") return StateCode::kInt8;
  if (name == "fp8") return StateCode::kFp8;
  TORCH_CHECK(false, "ampfuse.", kAdamCoded, ": state_dtype='", std::string(name),
              "' is not one of 'int8', 'fp8' (fp32 moments are stepped by fused_adam_).");
}

// The dtype of a moment's codes: int8 codes the first moment in a signed byte and the second
// in an unsigned one; fp8 codes both as e4m3.
at::ScalarType code_dtype(StateCode code, bool second) {
  if (code == StateCode::kFp8) return at::kFloat8_e4m3fn;
  return second ? at::kByte : at::kChar;
}

std::string dtype_name(at::ScalarType dtype) {
  return "torch." + c10::getDtypeNames(dtype).first;
}

// Validates one coded moment of every param (see the schema in registration.cpp) into
// `codes_out` and `scales_out`: the codes as bytes (the TensorRef's dtype is unused), the
// scales as fp32. `optional`: an empty pair of lists is accepted (max_exp_avg_sq without
// amsgrad).
void coded_list(at::TensorList codes, at::TensorList scales, const char* codes_name,
                const char* scales_name, at::TensorList params, StateCode code, bool second,
                bool optional, std::vector<kernels::TensorRef>& codes_out,
                std::vector<kernels::TensorRef>& scales_out) {
  if (optional && codes.empty() && scales.empty()) return;
  for (const auto& [list, name] : {std::pair{codes, codes_name}, std::pair{scales, scales_name}}) {
    TORCH_CHECK(list.size() == params.size(), "ampfuse.", kAdamCoded, ": ", name, " has ",
                list.size(), " tensors but params has ", params.size(), "; pass one per param",
                optional ? " (or empty lists)." : ".");
  }
  const at::ScalarType expected = code_dtype(code, second);
  const char* state_dtype = code == StateCode::kFp8 ? "fp8" : "int8";
  for (std::size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& c = codes[i];
    const at::Tensor& s = scales[i];
    const at::Tensor& p = params[i];
    const ArgLabel label{codes_name, static_cast<std::int64_t>(i)};
    const ArgLabel scale_label{scales_name, static_cast<std::int64_t>(i)};
    const ArgLabel param_label{"params", static_cast<std::int64_t>(i)};
    TORCH_CHECK(c.defined(), "ampfuse.", kAdamCoded, ": ", label, " is an undefined tensor.");
    TORCH_CHECK(c.scalar_type() == expected, "ampfuse.", kAdamCoded, ": ", label, " must be ",
                dtype_name(expected), " with state_dtype='", state_dtype, "', got ",
                dtype_name(c.scalar_type()), "; create it with torch.zeros_like(param, dtype=",
                dtype_name(expected), ").");
    TORCH_CHECK(c.sizes() == p.sizes(), "ampfuse.", kAdamCoded, ": ", label, " has shape ",
                c.sizes(), " but ", param_label, " has shape ", p.sizes(),
                "; codes are shaped like their param.");
    TORCH_CHECK(c.device() == p.device(), "ampfuse.", kAdamCoded, ": ", label, " is on ",
                c.device(), " but ", param_label, " is on ", p.device(), ".");
    TORCH_CHECK(c.layout() == at::kStrided && c.is_non_overlapping_and_dense() &&
                    c.strides() == p.strides(),
                "ampfuse.", kAdamCoded, ": ", label, " has strides ", c.strides(), " but ",
                param_label, " has strides ", p.strides(), "; create it with "
                "torch.zeros_like(param, dtype=", dtype_name(expected),
                ") so both share one memory layout.");
    const std::int64_t blocks = (p.numel() + kStateBlock - 1) / kStateBlock;
    TORCH_CHECK(s.defined() && s.scalar_type() == at::kFloat, "ampfuse.", kAdamCoded, ": ",
                scale_label, " must be torch.float32 (one absmax per block), got ",
                s.defined() ? dtype_name(s.scalar_type()) : std::string("None"), ".");
    TORCH_CHECK(s.device() == p.device(), "ampfuse.", kAdamCoded, ": ", scale_label, " is on ",
                s.device(), " but ", param_label, " is on ", p.device(), ".");
    TORCH_CHECK(s.dim() == 1 && s.numel() == blocks && s.is_contiguous(), "ampfuse.", kAdamCoded,
                ": ", scale_label, " must be a contiguous 1-D tensor of ", blocks,
                " elements (one per block of ", kStateBlock, " of ", param_label, "'s ",
                p.numel(), "), got shape ", s.sizes(), " and strides ", s.strides(),
                "; create it with torch.zeros(", blocks, ", dtype=torch.float32).");
    codes_out.push_back({c.data_ptr(), c.numel(), kernels::DType::kFloat32});
    scales_out.push_back({s.data_ptr(), s.numel(), kernels::DType::kFloat32});
  }
}

// The CPU step from the checked arguments.
void adam_coded_cpu(const AdamCodedArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const kernels::AdamStep adam_step = cpu_step_constants(a.config, a.scalars);
  const std::vector<Span> spans = split_into_spans(a.params);
  for_each_span(spans, [&](std::size_t s) {
    const Span& span = spans[s];
    const kernels::TensorRef& param = a.params[span.tensor];
    const kernels::TensorRef& grad = a.grads[span.tensor];
    const bool bf16_mode = a.masters.is_bf16_mode();
    kernels::cpu::Bf16Span bf16{};
    if (bf16_mode) bf16 = a.masters.span(span, adam_step.steps_taken);
    kernels::cpu::adam_coded_span(
        element_ptr(param, span.offset), param.dtype, element_ptr(grad, span.offset), grad.dtype,
        a.write_grads, span_moments(a.moments, span),
        bf16_mode ? nullptr : optional_fp32_ptr(a.masters.list, span),
        bf16_mode ? &bf16 : nullptr, span.size, adam_step);
  });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step from the checked arguments.
void adam_coded_cuda(const AdamCodedArgs& a, const at::Tensor& step) {
  check_cuda_step(kAdamCoded, step);
  // An empty list still advances the step count, as on the CPU (the prologue does it).
  const c10::cuda::CUDAGuard guard(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::AdamStep>(step.device());
  kernels::cuda::adam_coded(a.params, a.grads, a.moments, a.masters.list, a.config, a.scalars,
                            a.write_grads, static_cast<kernels::AdamStep*>(constants.data_ptr()),
                            current_stream(step.device()), a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_adam_coded_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_adam_coded_(at::TensorList params, at::TensorList grads,
                       at::TensorList exp_avg_codes, at::TensorList exp_avg_scales,
                       at::TensorList exp_avg_sq_codes, at::TensorList exp_avg_sq_scales,
                       at::TensorList max_exp_avg_sq_codes, at::TensorList max_exp_avg_sq_scales,
                       at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                       double beta1, double beta2, double eps, double weight_decay,
                       bool adam_w_mode, bool bias_correction, bool amsgrad, bool maximize,
                       const c10::optional<at::Tensor>& grad_scale,
                       const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                       c10::string_view state_dtype, c10::string_view master_mode,
                       at::IntArrayRef param_ids, int64_t seed) {
  check_moment_hyperparameters(kAdamCoded, beta1, beta2, eps);
  TORCH_CHECK(amsgrad || (max_exp_avg_sq_codes.empty() && max_exp_avg_sq_scales.empty()),
              "ampfuse.", kAdamCoded, ": max_exp_avg_sq_codes and max_exp_avg_sq_scales must be "
              "empty when amsgrad is False.");
  AdamCodedArgs a;
  const StateCode code = parse_state_dtype(state_dtype);
  a.moments.code = code;
  // Any size: which params code their moments is the optimizer's choice, by the whole param's
  // size, so an FSDP2 rank may hold a shard of a coded param under one block, or none of it.
  // A param that is not dense is stepped through a contiguous copy (see WrittenList).
  const WrittenList written(kAdamCoded, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kAdamCoded, params, "params");
  a.params = tensor_refs(kAdamCoded, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kAdamCoded, step, lr, grad_scale, found_inf, device);
  a.write_grads = writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kAdamCoded, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  kernels::cuda::CodedMomentLists& m = a.moments;
  coded_list(exp_avg_codes, exp_avg_scales, "exp_avg_codes", "exp_avg_scales", dense, code,
             /*second=*/false, /*optional=*/false, m.exp_avg_codes, m.exp_avg_scales);
  coded_list(exp_avg_sq_codes, exp_avg_sq_scales, "exp_avg_sq_codes", "exp_avg_sq_scales", dense,
             code, /*second=*/true, /*optional=*/false, m.exp_avg_sq_codes, m.exp_avg_sq_scales);
  coded_list(max_exp_avg_sq_codes, max_exp_avg_sq_scales, "max_exp_avg_sq_codes",
             "max_exp_avg_sq_scales", dense, code, /*second=*/true, /*optional=*/!amsgrad,
             m.max_exp_avg_sq_codes, m.max_exp_avg_sq_scales);
  a.masters = master_args(kAdamCoded, master_mode, dense, master_params, param_ids, seed,
                          a.keep_alive);
  a.config = {beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, amsgrad, maximize};
  if constexpr (kDevice == at::kCPU) {
    adam_coded_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    adam_coded_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_adam_coded_kernels() { return AMPFUSE_KERNELS(fused_adam_coded_); }

}  // namespace ampfuse::ops
