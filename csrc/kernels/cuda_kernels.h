// Launchers for the CUDA kernels. Plain pointers, sizes and a stream: no torch
// and no CUDA headers, so the op layer includes this in any build. Launchers
// enqueue work on `stream` and never synchronize with the host; a failed launch
// throws std::runtime_error.
#pragma once

#include <cstdint>
#include <vector>

#include "adagrad_math.h"
#include "bf16_modes.h"
#include "dtype.h"
#include "lamb_math.h"
#include "novograd_math.h"
#include "optimizer_math.h"
#include "state_codes.h"

namespace ampfuse::kernels::cuda {

// The next three take `tensor_flags`, null or one int32 per tensor of the list they read:
// tensor_flags[i] |= kHeldInf / kHeldNan (nonfinite_kind.h) if tensor i held an inf / a nan.

// g *= *inv_scale for every tensor of `grads`; *found_inf = 1 if any element is inf/nan.
void unscale(const std::vector<TensorRef>& grads, float* found_inf, const float* inv_scale,
             std::int32_t* tensor_flags, StreamHandle stream);

// *found_inf = 1 if any element of `tensors` is inf/nan; the tensors are only read.
void nonfinite_check(const std::vector<TensorRef>& tensors, float* found_inf,
                     std::int32_t* tensor_flags, StreamHandle stream);

// dst[i] = src[i] * *scale cast to dst's type; *found_inf = 1 if any src element is inf/nan.
void scale(const std::vector<TensorRef>& src, const std::vector<TensorRef>& dst, const float* scale,
           float* found_inf, std::int32_t* tensor_flags, StreamHandle stream);

// Scratch the l2norm launcher needs: one float and one int32 per 64K-element chunk.
std::int64_t l2norm_scratch_chunks(const std::vector<TensorRef>& tensors);

// *global_norm = ||all tensors||_2 and, when per_tensor_norms is not null,
// per_tensor_norms[i] = ||tensors[i]||_2. `chunk_sums` and `chunk_owner` hold
// l2norm_scratch_chunks(tensors) elements each. Deterministic: no atomics.
void l2norm(const std::vector<TensorRef>& tensors, float* chunk_sums, std::int32_t* chunk_owner,
            float* global_norm, float* per_tensor_norms, StreamHandle stream);

// One step of apply_scale_rule (scale_rule.h) on device scalars.
void update_scale(float* scale, std::int32_t* growth_tracker, std::int32_t* hysteresis_tracker,
                  const float* found_inf, double growth_factor, double backoff_factor,
                  std::int64_t growth_interval, std::int64_t hysteresis, double min_scale,
                  double max_scale, StreamHandle stream);

// Adam/AdamW over lists of equal length: params (any float dtype), grads (any),
// exp_avgs and exp_avg_sqs (fp32); max_exp_avg_sqs (fp32) only when amsgrad and
// masters (fp32) optional: pass empty vectors when absent. Grads are divided by
// *scalars.grad_scale and, with write_grads, stored back so. `constants` is device
// memory for one AdamStep, which a one-thread prologue fills before the update; the
// prologue also advances *scalars.step (not on overflow), so an empty list still costs
// one launch. `master_mode` says what `masters` holds (bf16_modes.h).
void adam(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& max_exp_avg_sqs, const std::vector<TensorRef>& masters,
          const AdamConfig& config, const StepScalars& scalars, bool write_grads,
          AdamStep* constants, StreamHandle stream, const MasterListMode& master_mode = {});

// Adam's moments as 8-bit block codes (state_codes.h), per param: codes laid out like it (one
// byte per element; the TensorRef's dtype is unused) and one fp32 scale per block of
// kStateBlock elements (a TensorRef of the scales, numel the block count). The max_exp_avg_sq
// lists are empty unless amsgrad.
struct CodedMomentLists {
  StateCode code;
  std::vector<TensorRef> exp_avg_codes, exp_avg_scales;
  std::vector<TensorRef> exp_avg_sq_codes, exp_avg_sq_scales;
  std::vector<TensorRef> max_exp_avg_sq_codes, max_exp_avg_sq_scales;
};

// adam with coded moments (fused_adam_coded_): each block decoded, updated as adam updates
// fp32 moments, and coded again; every param has at least kStateBlock elements. The rest as
// for adam.
void adam_coded(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
                const CodedMomentLists& moments, const std::vector<TensorRef>& masters,
                const AdamConfig& config, const StepScalars& scalars, bool write_grads,
                AdamStep* constants, StreamHandle stream, const MasterListMode& master_mode);

// SGD; momentum_buffers (fp32) empty when momentum is 0, masters optional; grads,
// constants and the step count as for adam.
void sgd(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
         const std::vector<TensorRef>& momentum_buffers, const std::vector<TensorRef>& masters,
         const SgdConfig& config, const StepScalars& scalars, bool write_grads, SgdStep* constants,
         StreamHandle stream, const MasterListMode& master_mode = {});

// Adagrad (adagrad_math.h); state_sums (fp32) hold each element's running sum of squared
// grads, masters (fp32) optional or a bf16 mode's extra arrays (`master_mode`); grads,
// constants and the step count as for adam.
void adagrad(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
             const std::vector<TensorRef>& state_sums, const std::vector<TensorRef>& masters,
             const AdagradConfig& config, const StepScalars& scalars, bool write_grads,
             AdagradStep* constants, StreamHandle stream, const MasterListMode& master_mode = {});

// Scratch the lamb launcher needs: lamb_scratch_chunks(params) 64K-element chunks, each with
// two floats of chunk_sums (its param's and its update's sum of squares) and one int32 of
// chunk_owner.
std::int64_t lamb_scratch_chunks(const std::vector<TensorRef>& params);

// LAMB (lamb_math.h) over lists of equal length: params (any float dtype), grads (any),
// exp_avgs and exp_avg_sqs (fp32), masters (fp32) optional (empty vector when absent).
// grad_norm: the global norm of the grads as passed (still carrying the loss scale), a device
// float read only when config.max_grad_norm > 0 (may be null otherwise). A one-thread prologue
// fills `constants` (device memory for one LambStep) and advances the step count unless
// *scalars.found_inf != 0; the first pass updates the moments and writes each chunk's sums of
// squares into chunk_sums/chunk_owner; a finishing kernel turns each tensor's sums into its
// step size in `ratios` (one float per tensor); the second pass updates the params. On
// overflow nothing but the scratch is written. Deterministic: no atomics.
// `part` (lamb_math.h) splits the step: kMoments stops after the first pass (the step count is
// not advanced) and writes each tensor's two sums of squares, as doubles, to tensor_sums[2t]
// (param) and tensor_sums[2t + 1] (update); kApply reads them there instead of running the first
// pass (grads, chunk_sums and chunk_owner are not read; grad_norm may be null), forms the
// ratios, runs the second pass and advances the count. kBoth also writes tensor_sums when it is
// not null. master_mode and masters as for adam: in a bf16 mode both passes read the value
// the mode holds, and only the second writes the params (and their compensations or low halves).
void lamb(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
          const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& exp_avg_sqs,
          const std::vector<TensorRef>& masters, const LambConfig& config,
          const StepScalars& scalars, const float* grad_norm, bool write_grads, LambStep* constants,
          float* chunk_sums, std::int32_t* chunk_owner, float* ratios, StreamHandle stream,
          LambPart part = LambPart::kBoth, double* tensor_sums = nullptr,
          const MasterListMode& master_mode = {});

// lamb with Adam's moments as 8-bit block codes (fused_lamb_coded_; CodedMomentLists without
// max_exp_avg_sq), decoded and coded inside the passes: equal bit for bit to decoding them,
// running lamb and coding the new moments. The first pass writes only the chunk sums (never the
// grads, whatever write_grads says); the second forms the new moments again, steps the params,
// codes the moments and, with write_grads, writes the unscaled grads. The rest as for lamb.
void lamb_coded(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
                const CodedMomentLists& moments, const std::vector<TensorRef>& masters,
                const LambConfig& config, const StepScalars& scalars, const float* grad_norm,
                bool write_grads, LambStep* constants, float* chunk_sums, std::int32_t* chunk_owner,
                float* ratios, StreamHandle stream, LambPart part, double* tensor_sums,
                const MasterListMode& master_mode);

// Scratch the novograd launcher needs: novograd_scratch_chunks(params) 64K-element chunks, each
// with one float of chunk_partials (its grads' sum of squares, or max |g|) and one int32 of
// chunk_owner.
std::int64_t novograd_scratch_chunks(const std::vector<TensorRef>& params);

// NovoGrad (novograd_math.h) over lists of equal length: params (any float dtype), grads (any),
// exp_avgs (fp32, shaped as the params), norm_avgs (fp32, ONE element per tensor: its running
// grad norm), masters (fp32) optional (empty vector when absent) or a bf16 mode's extra arrays
// (`master_mode`, read and written by the second pass only). A one-thread prologue fills
// `constants` (device memory for one NovoGradStep) and advances the step count unless
// *scalars.found_inf != 0 (not in kNorms, which leaves that to kApply); the first pass reduces
// each chunk's unscaled grads into chunk_partials/chunk_owner; a finishing kernel adds (or
// maxes) each tensor's partials in a fixed order into tensor_reductions[t] (a double per tensor,
// always required: scratch for kBoth) and blends it into norm_avgs[t]; the second pass updates
// exp_avgs, the masters and the params, and with write_grads stores the unscaled grads. On
// overflow nothing but the scratch is written. Deterministic: no atomics.
// kNorms runs the first pass and the finishing kernel without the blend (tensor_reductions
// then hold this shard's reductions); kApply takes tensor_reductions as given (combined over the
// shards by the caller), blends and runs the second pass.
void novograd(const std::vector<TensorRef>& params, const std::vector<TensorRef>& grads,
              const std::vector<TensorRef>& exp_avgs, const std::vector<TensorRef>& norm_avgs,
              const std::vector<TensorRef>& masters, const NovoGradConfig& config,
              const StepScalars& scalars, bool write_grads, NovoGradStep* constants,
              float* chunk_partials, std::int32_t* chunk_owner, double* tensor_reductions,
              StreamHandle stream, NovoGradPart part = NovoGradPart::kBoth,
              const MasterListMode& master_mode = {});

}  // namespace ampfuse::kernels::cuda
