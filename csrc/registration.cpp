// The one list of ampfuse's ops: every schema (torch.ops.ampfuse.*), one comment each, and the
// kernels bound to it. Fake (meta) kernels live in python/ampfuse/ops/ (one module per family).
// In-place ops end in `_`, mark what they mutate with alias annotations and return
// (); scales and overflow flags are device tensors so no op reads a value back to
// the host on the training hot path.
// Adding an op: docs/contributing.md, "Adding an op".
#include <torch/library.h>

#include <cstring>
#include <string>
#include <utility>

#include "ops.h"
#include "ops/refusals.h"

namespace {

namespace ops = ampfuse::ops;

torch::CppFunction refusal() {
  return torch::CppFunction::makeFromBoxedFunction<&ops::refuse_unsupported_inputs>();
}

// Defines an op by its schema and binds its kernels to every dispatch key ampfuse fills, so
// that one entry of the list below is the whole registration of an op:
//   CPU, CUDA                  its kernels;
//   CompositeExplicitAutograd  reached when no CPU or CUDA kernel is picked: sparse, quantized
//                              or mkldnn tensors, devices ampfuse has no kernels for, and no
//                              tensor at all (an empty list). The op's fallback if it has one,
//                              else the refusal, ampfuse's own error naming the tensor and the
//                              fix (never the dispatcher's "Could not run ...");
//   AutogradNestedTensor       the refusal: nested tensors reach their autograd key before any
//                              backend.
void def(torch::Library& m, const char* schema, ops::OpKernels kernels) {
  const std::string name(schema, std::strchr(schema, '('));
  m.def(schema);
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, std::move(kernels.cpu)));
  if (kernels.cuda.has_value()) {
    m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CUDA, std::move(*kernels.cuda)));
  }
  m.impl(name.c_str(),
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                         kernels.fallback.has_value() ? std::move(*kernels.fallback) : refusal()));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::AutogradNestedTensor, refusal()));
}

}  // namespace

TORCH_LIBRARY(ampfuse, m) {
  // The optional tensor_flags of the next three ops (int32, one per tensor of the list read)
  // name the overflowing tensors: the kernels OR 1 into tensor_flags[i] if tensor i held an
  // inf and 2 if it held a nan, in the same pass, and never clear them (as found_inf).
  // grads[i] *= inv_scale in fp32 math (fp32/fp16/bf16, mixed); found_inf = 1 if any inf/nan.
  def(m,
      "multi_tensor_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "Tensor(c!)? tensor_flags=None) -> ()",
      ops::multi_tensor_unscale_kernels());
  // dst[i] = src[i] * scale cast to dst[i]'s dtype; found_inf = 1 if any src element is inf/nan.
  def(m,
      "multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf, "
      "Tensor(c!)? tensor_flags=None) -> ()",
      ops::multi_tensor_scale_kernels());
  // found_inf = 1 if any element of the tensors is inf/nan; the tensors are only read, and a
  // set found_inf is never cleared (a guard for steps no loss scaler checks, e.g. bf16).
  def(m,
      "multi_tensor_nonfinite_check_(Tensor[] tensors, Tensor(a!) found_inf, "
      "Tensor(b!)? tensor_flags=None) -> ()",
      ops::multi_tensor_nonfinite_check_kernels());
  // (global L2 norm, per-tensor L2 norms or an empty tensor), in fp32.
  def(m, "multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)",
      ops::multi_tensor_l2norm_kernels());
  // One step of the dynamic loss-scale rule with hysteresis and [min_scale, max_scale] bounds.
  def(m,
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()",
      ops::update_scale_kernels());
  // Adam/AdamW step over lists: fp32 moments and optional fp32 masters, grads of any float
  // dtype divided by grad_scale (and, with write_unscaled_grads, stored back so divided, as
  // torch's fused optimizers leave them), step advanced on the device; a set found_inf writes
  // nothing at all. master_mode "stochastic", "kahan" or "split" updates bf16 params without
  // fp32 masters: master_params then holds nothing, bf16 compensations or int16 low halves,
  // and stochastic rounding is keyed by (seed, step, param_ids[i], element index).
  def(m,
      "fused_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] master_params, "
      "Tensor(g!) step, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adam_w_mode, bool bias_correction, bool amsgrad, bool maximize, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()",
      ops::fused_adam_kernels());
  // fused_adam_ with Adam's moments as 8-bit block codes (state_dtype "int8" or "fp8", the
  // format of python/ampfuse/optimizers/_state_codes.py), decoded, stepped and coded again in
  // one pass: bit for bit dequantize -> fused_adam_ -> quantize. Codes are shaped and laid out
  // like their param (int8: exp_avg torch.int8, the second moments torch.uint8; fp8: all
  // torch.float8_e4m3fn), scales hold one fp32 absmax per block of 256 elements in memory
  // order; every param has at least 256 elements. The rest as fused_adam_.
  def(m,
      "fused_adam_coded_(Tensor(a!)[] params, Tensor(b!)[] grads, "
      "Tensor(c!)[] exp_avg_codes, Tensor(d!)[] exp_avg_scales, "
      "Tensor(e!)[] exp_avg_sq_codes, Tensor(f!)[] exp_avg_sq_scales, "
      "Tensor(g!)[] max_exp_avg_sq_codes, Tensor(h!)[] max_exp_avg_sq_scales, "
      "Tensor(i!)[] master_params, Tensor(j!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
      "bool bias_correction, bool amsgrad, bool maximize, Tensor? grad_scale, "
      "Tensor? found_inf, *, bool write_unscaled_grads=True, str state_dtype=\"int8\", "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()",
      ops::fused_adam_coded_kernels());
  // SGD step (momentum, dampening, nesterov, weight decay before or after the momentum,
  // maximize), same contract as Adam, master modes included.
  def(m,
      "fused_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, "
      "Tensor(d!)[] master_params, Tensor(e!) step, Tensor lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize, Tensor? grad_scale, "
      "Tensor? found_inf, bool write_unscaled_grads=False, bool wd_after_momentum=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()",
      ops::fused_sgd_kernels());
  // Adagrad step (torch.optim.Adagrad's math; decoupled_weight_decay is apex FusedAdagrad's
  // adagrad_w_mode): state_sums += g * g, param -= clr * g / (sqrt(state_sums) + eps) with
  // clr = lr / (1 + step * lr_decay). fp32 sums and optional fp32 masters; grads, step,
  // found_inf, write_unscaled_grads and the master modes as for Adam.
  def(m,
      "fused_adagrad_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] state_sums, "
      "Tensor(d!)[] master_params, Tensor(e!) step, Tensor lr, float lr_decay, "
      "float weight_decay, float eps, bool decoupled_weight_decay, bool maximize, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()",
      ops::fused_adagrad_kernels());
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
  def(m,
      "fused_lamb_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] master_params, Tensor(f!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
      "bool bias_correction, bool grad_averaging, bool use_nvlamb, float max_grad_norm, "
      "Tensor? grad_norm, Tensor? grad_scale, Tensor? found_inf, "
      "bool write_unscaled_grads=False, Tensor(h!)? tensor_sums=None, str part=\"both\", "
      "str master_mode=\"fp32\", int[] param_ids=[], int seed=0) -> ()",
      ops::fused_lamb_kernels());
  // fused_lamb_ with block-coded moments (state_dtype "int8": int8 exp_avg codes, uint8
  // exp_avg_sq codes; "fp8": float8_e4m3fn both), codes shaped and laid out like each param,
  // one fp32 scale per 256 elements in memory order: bit for bit decode -> fused_lamb_ ->
  // encode. The codes are written by the second pass, which forms the moments again, so
  // part="moments" writes only tensor_sums and part="apply" takes the grads (and grad_norm
  // when clipping) as well (csrc/ops/lamb_coded.cpp).
  def(m,
      "fused_lamb_coded_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avg_codes, "
      "Tensor(d!)[] exp_avg_scales, Tensor(e!)[] exp_avg_sq_codes, "
      "Tensor(f!)[] exp_avg_sq_scales, Tensor(g!)[] master_params, Tensor(h!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
      "bool bias_correction, bool grad_averaging, bool use_nvlamb, float max_grad_norm, "
      "Tensor? grad_norm, Tensor? grad_scale, Tensor? found_inf, "
      "bool write_unscaled_grads=False, Tensor(i!)? tensor_sums=None, str part=\"both\", *, "
      "str state_dtype=\"int8\", str master_mode=\"fp32\", int[] param_ids=[], "
      "int seed=0) -> ()",
      ops::fused_lamb_coded_kernels());
  // NovoGrad step (apex.optimizers.FusedNovoGrad's math): each param keeps one running norm
  // of its grads in norm_avgs (a one-element float32 tensor: L2 norms blend as
  // sqrt(beta2 * avg^2 + (1 - beta2) * ||g||^2), max norms (norm_type=0) linearly), starting
  // from the first step's norm unless init_zero; the first moment takes the grad divided by
  // the bias-corrected running norm (reg_inside_moment) or the step divides by it after.
  // fp32 moments and optional fp32 masters; grads, step, found_inf, write_unscaled_grads and
  // the master modes as for Adam (a bf16 mode touches the second pass only). part="norms" leaves
  // each tensor's reduction of its grads (sum of squares or max |g|) in tensor_reductions (float64
  // [n]) and stops; part="apply" takes them from there and runs the rest; a sharded (FSDP2) step
  // combines them over the shards in between.
  def(m,
      "fused_novograd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] norm_avgs, Tensor(e!)[] master_params, Tensor(f!) step, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool bias_correction, "
      "bool grad_averaging, bool reg_inside_moment, int norm_type, bool init_zero, "
      "Tensor? grad_scale, Tensor? found_inf, bool write_unscaled_grads=False, "
      "Tensor(h!)? tensor_reductions=None, str part=\"both\", str master_mode=\"fp32\", "
      "int[] param_ids=[], int seed=0) -> ()",
      ops::fused_novograd_kernels());
  // FP8 (delayed scaling). input * scale saturated to dtype's range (e4m3fn or e5m2) and
  // cast; amax = max(amax, max |input|), nan propagating, in the same pass.
  def(m, "fp8_cast_amax(Tensor input, Tensor scale, Tensor(a!) amax, ScalarType dtype) -> Tensor",
      ops::fp8_cast_amax_kernels());
  // For each FP8 tensor: roll its amax history, insert the step's amax (then zero it), and set
  // scale = fp8_max / amax / 2**margin (amax by "max" or "most_recent"; the old scale stays
  // when amax is 0 or not finite) and scale_inv = 1 / scale. A set found_inf drops the step.
  // No two state tensors may share memory (refused: CUDA updates all states at once).
  def(m,
      "fp8_update_scales_(Tensor(a!)[] amaxes, Tensor(b!)[] amax_histories, "
      "Tensor(c!)[] scales, Tensor(d!)[] scale_invs, float[] fp8_maxes, int margin, "
      "str amax_compute, Tensor? found_inf=None) -> ()",
      ops::fp8_update_scales_kernels());
  // (a @ b.T) * scales + bias for fp8 a [m, k] and b [n, k]: cuBLASLt on CUDA, its fp32
  // emulation on the CPU. Scales tensorwise (one element each) or rowwise (a_scale_inv [m],
  // b_scale_inv [n], both operands e4m3); out_dtype bf16, fp16 or fp32, bias of out_dtype.
  // use_fast_accum: cuBLASLt's FP8 fast accumulation (the CPU emulation ignores it).
  def(m,
      "fp8_gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor? bias, "
      "ScalarType out_dtype, bool use_fast_accum=False) -> Tensor",
      ops::fp8_gemm_kernels());
  // {plans built, plans reused, plans evicted, per-thread capacity} of fp8_gemm's cuBLASLt
  // plan cache, over the process: debug counters for tests and benchmarks (host-side, no
  // tensors, like the o1_ helpers).
  m.def("fp8_gemm_plan_stats() -> int[]", &ops::fp8_gemm_plan_stats);
  // A contiguous [k, m] copy of a 2-D fp8 tensor [m, k]: the K-contiguous operands an FP8
  // layer's backward GEMMs take.
  def(m, "fp8_transpose(Tensor input) -> Tensor", ops::fp8_transpose_kernels());
  // FP8 current scaling. amax = max |input| (nan winning), scale = fp8_max(dtype) / amax /
  // 2**margin and scale_inv = 1 / scale, computed on the input's device (no host sync), each a
  // fresh fp32 [1]. amax 0 gives scale 1; an inf or nan amax gives a nan scale and scale_inv.
  def(m,
      "fp8_tensor_scale(Tensor input, ScalarType dtype, float margin=0.) -> "
      "(Tensor amax, Tensor scale, Tensor scale_inv)",
      ops::fp8_tensor_scale_kernels());
  // One pass over a 2-D input [m, k]: its fp8 codes (input * scale, saturated) [m, k], the
  // same codes transposed [k, m] (contiguous), and amax = max(amax, max |input|), nan winning.
  def(m,
      "fp8_cast_transpose(Tensor input, Tensor scale, Tensor(a!) amax, ScalarType dtype) -> "
      "(Tensor, Tensor)",
      ops::fp8_cast_transpose_kernels());
  // fp8_cast_transpose plus dbias = input.sum(0) accumulated in fp32 (fp32 [k]).
  def(m,
      "fp8_cast_transpose_dbias(Tensor input, Tensor scale, Tensor(a!) amax, "
      "ScalarType dtype) -> (Tensor, Tensor, Tensor)",
      ops::fp8_cast_transpose_dbias_kernels());
  // Rowwise current scaling of a 2-D input [m, k]: transpose=False gives codes [m, k] and one
  // scale_inv per row [m]; transpose=True gives input.T's codes [k, m] and one scale_inv per
  // column of input [k]. Each scale follows fp8_tensor_scale's rule (no margin).
  def(m, "fp8_quantize_rowwise(Tensor input, ScalarType dtype, bool transpose) -> (Tensor, Tensor)",
      ops::fp8_quantize_rowwise_kernels());
}
