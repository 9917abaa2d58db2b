// fused_lamb_coded_: fused_lamb_ with block-coded moments (state_dtype "int8" / "fp8", see
// kernels/state_codes.h), equal bit for bit to decoding the moments, running fused_lamb_ on
// them in fp32 and coding the new moments again.
//
// LAMB's second pass reads the new moments at full precision (lamb_math.h recomputes the update
// from them), so the codes cannot be written by the first pass and read back by the second.
// Instead the first pass only forms each tensor's sums of squares from the decoded moments and
// writes nothing, and the second forms the new moments again from the same codes, grads and
// params (the same arithmetic, so the same bits), steps the params with them, codes them and
// writes the unscaled grads. On the CPU both passes are kernels/cpu/lamb_coded.h's, which decode
// and code inside their loops where the processor has AVX2 or AVX-512 (and through an fp32 span
// that lives for one span elsewhere); on CUDA they are kernels/lamb_coded.cu's, which decode and
// code inside the kernels.
// part="moments" is the first pass alone (it leaves only tensor_sums); part="apply" is the
// second, which therefore takes the grads and, when clipping, grad_norm as well.
#include "../kernels/cpu/lamb_coded.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/cpu/cpu_kernels.h"
#include "../kernels/cuda_kernels.h"
#include "../kernels/state_codes.h"
#include "../ops.h"
#include "checks.h"
#include "coded_args.h"
#include "cpu_spans.h"
#include "cuda_context.h"
#include "lamb_args.h"
#include "master_args.h"
#include "optimizer_args.h"

namespace ampfuse::ops {
namespace {

constexpr const char* kLambCoded = "fused_lamb_coded_";

struct LambCodedArgs {
  std::vector<kernels::TensorRef> params, grads;
  kernels::cuda::CodedMomentLists moments;  // without max_exp_avg_sq
  MasterArgs masters;
  kernels::LambConfig config;
  kernels::StepScalars scalars;
  const float* grad_norm;  // null without clipping
  kernels::LambPart part;
  double* tensor_sums;  // [n, 2] float64, null when not asked for (kBoth only)
  bool write_grads;     // the second pass writes the unscaled grads
  std::vector<at::Tensor> keep_alive;
  std::vector<CopyBack> copy_back;
};

// One span as both CPU passes take it: the param and grad at its start, its master or (in a
// bf16 mode) the mode's span, and its codes.
struct SpanArgs {
  void* param;
  kernels::DType param_dtype;
  bool bf16_mode;
  kernels::cpu::Bf16Span bf16;
  float* master;  // null in a bf16 mode or without masters
  void* grad;
  kernels::DType grad_dtype;
  kernels::cpu::CodedMoments moments;

  const kernels::cpu::Bf16Span* bf16_span() const { return bf16_mode ? &bf16 : nullptr; }
};

SpanArgs span_args(const LambCodedArgs& a, const Span& span, float steps_taken) {
  const kernels::TensorRef& param = a.params[span.tensor];
  const kernels::TensorRef& grad = a.grads[span.tensor];
  const bool bf16_mode = a.masters.is_bf16_mode();
  return {element_ptr(param, span.offset),
          param.dtype,
          bf16_mode,
          bf16_mode ? a.masters.span(span, steps_taken) : kernels::cpu::Bf16Span{},
          bf16_mode ? nullptr : optional_fp32_ptr(a.masters.list, span),
          element_ptr(grad, span.offset),
          grad.dtype,
          span_moments(a.moments, span)};
}

// LAMB's first pass over one span (sums only, nothing written) and its second (moments, params,
// codes and, when asked, the unscaled grads), as kernels/cpu/lamb_coded.h runs them.
void sums_span(const LambCodedArgs& a, const Span& span, const kernels::LambStep& lamb_step,
               double* param_sq, double* update_sq) {
  const SpanArgs s = span_args(a, span, lamb_step.steps_taken);
  kernels::cpu::lamb_coded_sums_span(s.param, s.param_dtype, s.bf16_span(), s.master, s.grad,
                                     s.grad_dtype, s.moments, span.size, lamb_step, param_sq,
                                     update_sq);
}

void step_span(const LambCodedArgs& a, const Span& span, const kernels::LambStep& lamb_step,
               float ratio) {
  const SpanArgs s = span_args(a, span, lamb_step.steps_taken);
  kernels::cpu::lamb_coded_step_span(s.param, s.param_dtype, s.bf16_span(), s.master, s.grad,
                                     s.grad_dtype, a.write_grads, s.moments, span.size, lamb_step,
                                     ratio);
}

// The CPU step from the checked arguments (see the file comment for the two passes).
void lamb_coded_cpu(const LambCodedArgs& a) {
  if (cpu_step_skipped(a.scalars)) return;
  const float grad_scale_value = a.scalars.grad_scale != nullptr ? *a.scalars.grad_scale : 1.0f;
  const kernels::LambStep lamb_step =
      kernels::make_lamb_constants(a.config, *a.scalars.step, *a.scalars.lr, grad_scale_value,
                                   a.grad_norm != nullptr ? *a.grad_norm : 0.0f);
  const std::vector<Span> spans = split_into_spans(a.params);
  const std::size_t n = a.params.size();
  std::vector<double> sums(2 * n, 0.0);
  // Without a trust ratio (no weight decay, no use_nvlamb) every ratio is lr: a whole step that
  // returns no sums needs no first pass.
  const bool sums_unused =
      !lamb_step.trust && a.part == kernels::LambPart::kBoth && a.tensor_sums == nullptr;
  if (a.part == kernels::LambPart::kApply) {
    std::copy(a.tensor_sums, a.tensor_sums + 2 * n, sums.begin());
  } else if (!sums_unused) {
    // First pass: each span's sums, from its decoded moments; nothing is written.
    std::vector<double> param_sq(spans.size(), 0.0), update_sq(spans.size(), 0.0);
    for_each_span(spans, [&](std::size_t s) {
      sums_span(a, spans[s], lamb_step, &param_sq[s], &update_sq[s]);
    });
    for (std::size_t s = 0; s < spans.size(); ++s) {
      sums[2 * spans[s].tensor] += param_sq[s];
      sums[2 * spans[s].tensor + 1] += update_sq[s];
    }
    if (a.tensor_sums != nullptr) std::copy(sums.begin(), sums.end(), a.tensor_sums);
    if (a.part == kernels::LambPart::kMoments) return;  // nothing else written, count unchanged
  }
  std::vector<float> ratios(n);
  for (std::size_t i = 0; i < n; ++i) {
    ratios[i] = kernels::lamb_ratio(static_cast<float>(std::sqrt(sums[2 * i])),
                                    static_cast<float>(std::sqrt(sums[2 * i + 1])), lamb_step);
  }
  // Second pass: the new moments again, the params from them, the moments coded.
  for_each_span(spans,
                [&](std::size_t s) { step_span(a, spans[s], lamb_step, ratios[spans[s].tensor]); });
  finish_copy_back(a.copy_back);
  *a.scalars.step += 1.0f;
}

#ifdef AMPFUSE_WITH_CUDA
// The CUDA step: kernels/lamb_coded.cu's two passes, with fused_lamb_'s scratch.
void lamb_coded_cuda(const LambCodedArgs& a, const at::Tensor& step) {
  check_cuda_step(kLambCoded, step);
  const c10::cuda::CUDAGuard guard(step.device());
  const auto options = at::TensorOptions().device(step.device());
  const at::Tensor constants = step_constants_buffer<kernels::LambStep>(step.device());
  const std::int64_t chunks = kernels::cuda::lamb_scratch_chunks(a.params);
  at::Tensor chunk_sums = at::empty({2 * chunks}, options.dtype(at::kFloat));
  at::Tensor chunk_owner = at::empty({chunks}, options.dtype(at::kInt));
  at::Tensor ratios =
      at::empty({static_cast<std::int64_t>(a.params.size())}, options.dtype(at::kFloat));
  kernels::cuda::lamb_coded(
      a.params, a.grads, a.moments, a.masters.list, a.config, a.scalars, a.grad_norm, a.write_grads,
      static_cast<kernels::LambStep*>(constants.data_ptr()), chunk_sums.data_ptr<float>(),
      chunk_owner.data_ptr<std::int32_t>(), ratios.data_ptr<float>(), current_stream(step.device()),
      a.part, a.tensor_sums, a.masters.how);
  finish_copy_back(a.copy_back);
}
#endif

// fused_lamb_coded_ on kDevice (see ../ops.h): the checks, then the step on that device.
template <c10::DeviceType kDevice>
void fused_lamb_coded_(at::TensorList params, at::TensorList grads, at::TensorList exp_avg_codes,
                       at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                       at::TensorList exp_avg_sq_scales, at::TensorList master_params,
                       const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
                       double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                       bool grad_averaging, bool use_nvlamb, double max_grad_norm,
                       const c10::optional<at::Tensor>& grad_norm,
                       const c10::optional<at::Tensor>& grad_scale,
                       const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                       const c10::optional<at::Tensor>& tensor_sums, c10::string_view part,
                       c10::string_view state_dtype, c10::string_view master_mode,
                       at::IntArrayRef param_ids, int64_t seed) {
  check_lamb_hyperparameters(kLambCoded, beta1, beta2, eps, weight_decay, max_grad_norm);
  LambCodedArgs a;
  a.moments.code = parse_state_dtype(kLambCoded, state_dtype, "fused_lamb_");
  a.part = parse_lamb_part(kLambCoded, part);
  const bool has_norm = grad_norm.has_value() && grad_norm->defined();
  // part="apply" forms the clipped moments again: it needs the norm too.
  TORCH_CHECK(max_grad_norm == 0.0 || has_norm, "ampfuse.", kLambCoded,
              ": max_grad_norm=", max_grad_norm,
              " clips by the global grad norm; pass it as grad_norm (a "
              "one-element float32 tensor, e.g. ampfuse's multi_tensor_l2norm of every grad of "
              "the step; with the coded moments part='apply' needs it too), or max_grad_norm=0 "
              "for no clipping.");
  // A param that is not dense is stepped through a contiguous copy (see WrittenList); its
  // codes are then contiguous too.
  const WrittenList written(kLambCoded, params, "params", a.copy_back);
  const at::TensorList dense = written.tensors();
  const c10::optional<at::Device> device = list_device(kLambCoded, params, "params");
  a.params = tensor_refs(kLambCoded, dense, "params", /*mutated=*/true, a.keep_alive);
  a.scalars = step_scalars(kLambCoded, step, lr, grad_scale, found_inf, device);
  a.tensor_sums =
      lamb_sums_ptr(kLambCoded, tensor_sums, a.part, params.size(), device.value_or(step.device()));
  a.grad_norm = nullptr;
  if (max_grad_norm > 0.0) {
    check_scalar_tensor(kLambCoded, *grad_norm, "grad_norm", at::kFloat,
                        device.value_or(step.device()),
                        device.has_value() ? "params" : "step, as params is empty");
    a.grad_norm = grad_norm->data_ptr<float>();
  }
  // The second pass writes the grads (part="moments" reads them only).
  a.write_grads =
      a.part != kernels::LambPart::kMoments && writes_grads(write_unscaled_grads, a.scalars);
  a.grads = grad_refs(kLambCoded, grads, dense, a.write_grads, a.keep_alive, a.copy_back);
  check_coded_moment(kLambCoded, dense, exp_avg_codes, "exp_avg_codes", exp_avg_scales,
                     "exp_avg_scales", a.moments.code, /*second=*/false, /*optional=*/false,
                     a.moments.exp_avg_codes, a.moments.exp_avg_scales);
  check_coded_moment(kLambCoded, dense, exp_avg_sq_codes, "exp_avg_sq_codes", exp_avg_sq_scales,
                     "exp_avg_sq_scales", a.moments.code, /*second=*/true, /*optional=*/false,
                     a.moments.exp_avg_sq_codes, a.moments.exp_avg_sq_scales);
  a.masters =
      master_args(kLambCoded, master_mode, dense, master_params, param_ids, seed, a.keep_alive);
  a.config = {beta1,           beta2,          eps,       weight_decay, max_grad_norm, adam_w_mode,
              bias_correction, grad_averaging, use_nvlamb};
  if constexpr (kDevice == at::kCPU) {
    lamb_coded_cpu(a);
  } else {
#ifdef AMPFUSE_WITH_CUDA
    lamb_coded_cuda(a, step);
#endif
  }
}

}  // namespace

OpKernels fused_lamb_coded_kernels() { return AMPFUSE_KERNELS(fused_lamb_coded_); }

}  // namespace ampfuse::ops
