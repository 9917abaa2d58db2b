// The one list of ampfuse's ops: every schema (torch.ops.ampfuse.*) and the CPU
// and CUDA kernels bound to it. Fake (meta) kernels live in python/ampfuse/_ops.py.
// In-place ops end in `_`, mark what they mutate with alias annotations and return
// (); scales and overflow flags are device tensors so no op reads a value back to
// the host on the training hot path.
#include <torch/library.h>

#include "ops.h"
#include "ops/refusals.h"

TORCH_LIBRARY(ampfuse, m) {
  // The optional tensor_flags of the next three ops (int32, one per tensor of the list read)
  // name the overflowing tensors: the kernels OR 1 into tensor_flags[i] if tensor i held an
  // inf and 2 if it held a nan, in the same pass, and never clear them (as found_inf).
  // grads[i] *= inv_scale in fp32 math (fp32/fp16/bf16, mixed); found_inf = 1 if any inf/nan.
  m.def(
      "multi_tensor_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "Tensor(c!)? tensor_flags=None) -> ()");
  // dst[i] = src[i] * scale cast to dst[i]'s dtype; found_inf = 1 if any src element is inf/nan.
  m.def(
      "multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf, "
      "Tensor(c!)? tensor_flags=None) -> ()");
  // found_inf = 1 if any element of the tensors is inf/nan; the tensors are only read, and a
  // set found_inf is never cleared (a guard for steps no loss scaler checks, e.g. bf16).
  m.def(
      "multi_tensor_nonfinite_check_(Tensor[] tensors, Tensor(a!) found_inf, "
      "Tensor(b!)? tensor_flags=None) -> ()");
  // (global L2 norm, per-tensor L2 norms or an empty tensor), in fp32.
  m.def("multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)");
  // One step of the dynamic loss-scale rule with hysteresis and [min_scale, max_scale] bounds.
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");
  // Adam/AdamW step over lists: fp32 moments and optional fp32 masters, grads of any float
  // dtype divided by grad_scale (and, with write_unscaled_grads, stored back so divided, as
  // torch's fused optimizers leave them), step advanced on the device; a set found_inf writes
  // nothing at all. master_mode "stochastic", "kahan" or "split" updates bf16 params without
  // fp32 masters: master_params then holds nothing, bf16 compensations or int16 low halves,
  // and stochastic rounding is keyed by (seed, step, param_ids[i], element index).
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] master_params, "
      "Tensor(g!) step, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adam_w_mode, bool bias_correction, bool amsgrad, bool maximize, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()");
  // SGD step (momentum, dampening, nesterov, weight decay before or after the momentum,
  // maximize), same contract as Adam, master modes included.
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
      "Tensor(d!)[] master_params, Tensor(e!) step, Tensor lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize, Tensor? grad_scale, "
      "Tensor? found_inf, bool write_unscaled_grads=False, bool wd_after_momentum=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()");
  // Adagrad step (torch.optim.Adagrad's math; decoupled_weight_decay is apex FusedAdagrad's
  // adagrad_w_mode): state_sums += g * g, param -= clr * g / (sqrt(state_sums) + eps) with
  // clr = lr / (1 + step * lr_decay). fp32 sums and optional fp32 masters; grads, step,
  // found_inf, write_unscaled_grads and the master modes as for Adam.
  m.def(
      "fused_adagrad_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] state_sums, "
      "Tensor(d!)[] master_params, Tensor(e!) step, Tensor lr, float lr_decay, "
      "float weight_decay, float eps, bool decoupled_weight_decay, bool maximize, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()");
  // LAMB step (apex.optimizers.FusedLAMB's math): Adam moments of the grads divided by
  // grad_scale and by the clip max(1, ||grads|| / grad_scale / max_grad_norm), where grad_norm is
  // the global norm of the step's grads as passed (max_grad_norm=0: no clipping, grad_norm
  // unused); each param moves by lr * ||param|| / ||update|| (the trust ratio; plain lr without
  // weight decay unless use_nvlamb). fp32 moments; master_params, master_mode, param_ids and
  // seed (fp32 masters or bf16 params without them), grads, step, found_inf and
  // write_unscaled_grads as for Adam. part="moments" runs the first pass alone
  // and leaves each tensor's sums of squares of param and update in tensor_sums (float64
  // [n, 2]); part="apply" takes them from there for the second pass and advances step; a
  // sharded (FSDP2) step adds them over the shards in between.
  m.def(
      "fused_lamb_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
      "bool bias_correction, bool grad_averaging, bool use_nvlamb, float max_grad_norm, "
      "Tensor? grad_norm, Tensor? grad_scale, Tensor? found_inf, "
      "bool write_unscaled_grads=False, Tensor(h!)? tensor_sums=None, str part=\"both\", "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()");
  // NovoGrad step (apex.optimizers.FusedNovoGrad's math): each param keeps one running norm
  // of its grads in norm_avgs (a one-element float32 tensor: L2 norms blend as
  // sqrt(beta2 * avg^2 + (1 - beta2) * ||g||^2), max norms (norm_type=0) linearly), starting
  // from the first step's norm unless init_zero; the first moment takes the grad divided by
  // the bias-corrected running norm (reg_inside_moment) or the step divides by it after.
  // fp32 moments and optional fp32 masters; grads, step, found_inf, write_unscaled_grads and
  // the master modes as for Adam (a bf16 mode touches the second pass only). part="norms" leaves each tensor's reduction of its grads (sum of squares or
  // max |g|) in tensor_reductions (float64 [n]) and stops; part="apply" takes them from there
  // and runs the rest; a sharded (FSDP2) step combines them over the shards in between.
  m.def(
      "fused_novograd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] norm_avgs, Tensor(e!)[] master_params, Tensor(f!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool bias_correction, "
      "bool grad_averaging, bool reg_inside_moment, int norm_type, bool init_zero, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "Tensor(h!)? tensor_reductions=None, str part=\"both\", str master_mode=\"fp32\", "
      "int[] param_ids=[], int seed=0) -> ()");
  // FP8 (delayed scaling). input * scale saturated to dtype's range (e4m3fn or e5m2) and
  // cast; amax = max(amax, max |input|), nan propagating, in the same pass.
  m.def("fp8_cast_amax(Tensor input, Tensor scale, Tensor(a!) amax, ScalarType dtype) -> Tensor");
  // For each FP8 tensor: roll its amax history, insert the step's amax (then zero it), and set
  // scale = fp8_max / amax / 2**margin (amax by "max" or "most_recent"; the old scale stays
  // when amax is 0 or not finite) and scale_inv = 1 / scale. A set found_inf drops the step.
  m.def(
      "fp8_update_scales_(Tensor(a!)[] amaxes, Tensor(b!)[] amax_histories, "
      "Tensor(c!)[] scales, Tensor(d!)[] scale_invs, float[] fp8_maxes, int margin, "
      "str amax_compute, Tensor? found_inf=None) -> ()");
  // (a @ b.T) * a_scale_inv * b_scale_inv + bias for fp8 a [m, k], b [n, k]: cuBLASLt on CUDA,
  // its fp32 emulation on the CPU.
  m.def(
      "fp8_gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor? bias, "
      "ScalarType out_dtype) -> Tensor");
  // A contiguous [k, m] copy of a 2-D fp8 tensor [m, k]: the K-contiguous operands an FP8
  // layer's backward GEMMs take.
  m.def("fp8_transpose(Tensor input) -> Tensor");
}

TORCH_LIBRARY_IMPL(ampfuse, CPU, m) {
  m.impl("multi_tensor_unscale_", &ampfuse::ops::multi_tensor_unscale_cpu);
  m.impl("multi_tensor_nonfinite_check_", &ampfuse::ops::multi_tensor_nonfinite_check_cpu);
  m.impl("multi_tensor_scale_", &ampfuse::ops::multi_tensor_scale_cpu);
  m.impl("multi_tensor_l2norm", &ampfuse::ops::multi_tensor_l2norm_cpu);
  m.impl("update_scale_", &ampfuse::ops::update_scale_cpu);
  m.impl("fused_adam_", &ampfuse::ops::fused_adam_cpu);
  m.impl("fused_sgd_", &ampfuse::ops::fused_sgd_cpu);
  m.impl("fused_adagrad_", &ampfuse::ops::fused_adagrad_cpu);
  m.impl("fused_lamb_", &ampfuse::ops::fused_lamb_cpu);
  m.impl("fused_novograd_", &ampfuse::ops::fused_novograd_cpu);
  m.impl("fp8_cast_amax", &ampfuse::ops::fp8_cast_amax_cpu);
  m.impl("fp8_update_scales_", &ampfuse::ops::fp8_update_scales_cpu);
  m.impl("fp8_gemm", &ampfuse::ops::fp8_gemm_cpu);
  m.impl("fp8_transpose", &ampfuse::ops::fp8_transpose_cpu);
}

#ifdef AMPFUSE_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfuse, CUDA, m) {
  m.impl("multi_tensor_unscale_", &ampfuse::ops::multi_tensor_unscale_cuda);
  m.impl("multi_tensor_nonfinite_check_", &ampfuse::ops::multi_tensor_nonfinite_check_cuda);
  m.impl("multi_tensor_scale_", &ampfuse::ops::multi_tensor_scale_cuda);
  m.impl("multi_tensor_l2norm", &ampfuse::ops::multi_tensor_l2norm_cuda);
  m.impl("update_scale_", &ampfuse::ops::update_scale_cuda);
  m.impl("fused_adam_", &ampfuse::ops::fused_adam_cuda);
  m.impl("fused_sgd_", &ampfuse::ops::fused_sgd_cuda);
  m.impl("fused_adagrad_", &ampfuse::ops::fused_adagrad_cuda);
  m.impl("fused_lamb_", &ampfuse::ops::fused_lamb_cuda);
  m.impl("fused_novograd_", &ampfuse::ops::fused_novograd_cuda);
  m.impl("fp8_cast_amax", &ampfuse::ops::fp8_cast_amax_cuda);
  m.impl("fp8_update_scales_", &ampfuse::ops::fp8_update_scales_cuda);
  m.impl("fp8_gemm", &ampfuse::ops::fp8_gemm_cuda);
  m.impl("fp8_transpose", &ampfuse::ops::fp8_transpose_cuda);
}
#endif

// Reached when no CPU or CUDA kernel is picked: sparse, quantized or mkldnn tensors, devices
// ampfuse has no kernels for, and (l2norm, fp8_update_scales_) an empty list, whose norms are
// 0 on the CPU and whose update does nothing. Each
// refuses with ampfuse's own error naming the tensor and the fix.
TORCH_LIBRARY_IMPL(ampfuse, CompositeExplicitAutograd, m) {
  const auto refuse = [] {
    return torch::CppFunction::makeFromBoxedFunction<&ampfuse::ops::refuse_unsupported_inputs>();
  };
  m.impl("multi_tensor_unscale_", refuse());
  m.impl("multi_tensor_nonfinite_check_", refuse());
  m.impl("multi_tensor_scale_", refuse());
  m.impl("multi_tensor_l2norm", &ampfuse::ops::multi_tensor_l2norm_fallback);
  m.impl("update_scale_", refuse());
  m.impl("fused_adam_", refuse());
  m.impl("fused_sgd_", refuse());
  m.impl("fused_adagrad_", refuse());
  m.impl("fused_lamb_", refuse());
  m.impl("fused_novograd_", refuse());
  m.impl("fp8_cast_amax", refuse());
  m.impl("fp8_update_scales_", &ampfuse::ops::fp8_update_scales_fallback);
  m.impl("fp8_gemm", refuse());
  m.impl("fp8_transpose", refuse());
}

// Nested tensors dispatch to their autograd key before any backend.
TORCH_LIBRARY_IMPL(ampfuse, AutogradNestedTensor, m) {
  const auto refuse = [] {
    return torch::CppFunction::makeFromBoxedFunction<&ampfuse::ops::refuse_unsupported_inputs>();
  };
  for (const char* op : {"multi_tensor_unscale_", "multi_tensor_nonfinite_check_",
                         "multi_tensor_scale_", "multi_tensor_l2norm", "update_scale_",
                         "fused_adam_", "fused_sgd_", "fused_adagrad_", "fused_lamb_",
                         "fused_novograd_",
                         "fp8_cast_amax",
                         "fp8_update_scales_", "fp8_gemm", "fp8_transpose"}) {
    m.impl(op, refuse());
  }
}
