// Every op implementation, one declaration each; registration.cpp binds them to
// the schemas of torch.ops.ampfuse.*.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace ampfuse::ops {

void multi_tensor_unscale_cpu(at::TensorList grads, const at::Tensor& found_inf,
                              const at::Tensor& inv_scale,
                              const c10::optional<at::Tensor>& tensor_flags);
void multi_tensor_nonfinite_check_cpu(at::TensorList tensors, const at::Tensor& found_inf,
                                      const c10::optional<at::Tensor>& tensor_flags);
void multi_tensor_scale_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                            const at::Tensor& found_inf,
                            const c10::optional<at::Tensor>& tensor_flags);
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(at::TensorList tensors, bool per_tensor);
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_fallback(at::TensorList tensors,
                                                                bool per_tensor);
void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, std::int64_t growth_interval,
                      std::int64_t hysteresis, double min_scale, double max_scale);
void fused_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                    bool bias_correction, bool amsgrad, bool maximize,
                    const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                    c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                   double momentum, double dampening, double weight_decay, bool nesterov,
                   bool maximize, const c10::optional<at::Tensor>& grad_scale,
                   const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                   bool wd_after_momentum,
                   c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_adagrad_cpu(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                       at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                       double lr_decay, double weight_decay, double eps,
                       bool decoupled_weight_decay, bool maximize,
                       const c10::optional<at::Tensor>& grad_scale,
                       const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                       c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList master_params,
                    const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
                    double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                    bool grad_averaging, bool use_nvlamb, double max_grad_norm,
                    const c10::optional<at::Tensor>& grad_norm,
                    const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                    const c10::optional<at::Tensor>& tensor_sums, c10::string_view part,
                    c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_novograd_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList norm_avgs, at::TensorList master_params,
                        const at::Tensor& step, const at::Tensor& lr, double beta1,
                        double beta2, double eps, double weight_decay, bool bias_correction,
                        bool grad_averaging, bool reg_inside_moment, int64_t norm_type,
                        bool init_zero, const c10::optional<at::Tensor>& grad_scale,
                        const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                        const c10::optional<at::Tensor>& tensor_reductions,
                        c10::string_view part, c10::string_view master_mode,
                        at::IntArrayRef param_ids, int64_t seed);

// FP8 (csrc/ops/fp8.cpp, csrc/ops/fp8_gemm.cpp).
at::Tensor fp8_cast_amax_cpu(const at::Tensor& input, const at::Tensor& scale,
                             const at::Tensor& amax, at::ScalarType dtype);
void fp8_update_scales_cpu(at::TensorList amaxes, at::TensorList amax_histories,
                           at::TensorList scales, at::TensorList scale_invs,
                           at::ArrayRef<double> fp8_maxes, std::int64_t margin,
                           c10::string_view amax_compute,
                           const c10::optional<at::Tensor>& found_inf);
void fp8_update_scales_fallback(at::TensorList amaxes, at::TensorList amax_histories,
                                at::TensorList scales, at::TensorList scale_invs,
                                at::ArrayRef<double> fp8_maxes, std::int64_t margin,
                                c10::string_view amax_compute,
                                const c10::optional<at::Tensor>& found_inf);
at::Tensor fp8_gemm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                        const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                        at::ScalarType out_dtype);
at::Tensor fp8_transpose_cpu(const at::Tensor& input);  // csrc/ops/fp8_transpose.cpp

#ifdef AMPFUSE_WITH_CUDA
void multi_tensor_unscale_cuda(at::TensorList grads, const at::Tensor& found_inf,
                               const at::Tensor& inv_scale,
                               const c10::optional<at::Tensor>& tensor_flags);
void multi_tensor_nonfinite_check_cuda(at::TensorList tensors, const at::Tensor& found_inf,
                                       const c10::optional<at::Tensor>& tensor_flags);
void multi_tensor_scale_cuda(at::TensorList src, at::TensorList dst, const at::Tensor& scale,
                             const at::Tensor& found_inf,
                             const c10::optional<at::Tensor>& tensor_flags);
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors,
                                                            bool per_tensor);
void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, std::int64_t growth_interval,
                       std::int64_t hysteresis, double min_scale, double max_scale);
void fused_adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                     at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                     double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                     bool bias_correction, bool amsgrad, bool maximize,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                     c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                    double momentum, double dampening, double weight_decay, bool nesterov,
                    bool maximize, const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                    bool wd_after_momentum,
                    c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_adagrad_cuda(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                        at::TensorList master_params, const at::Tensor& step,
                        const at::Tensor& lr, double lr_decay, double weight_decay, double eps,
                        bool decoupled_weight_decay, bool maximize,
                        const c10::optional<at::Tensor>& grad_scale,
                        const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                        c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList master_params,
                     const at::Tensor& step, const at::Tensor& lr, double beta1, double beta2,
                     double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                     bool grad_averaging, bool use_nvlamb, double max_grad_norm,
                     const c10::optional<at::Tensor>& grad_norm,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                     const c10::optional<at::Tensor>& tensor_sums, c10::string_view part,
                     c10::string_view master_mode, at::IntArrayRef param_ids, int64_t seed);
void fused_novograd_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList norm_avgs, at::TensorList master_params,
                         const at::Tensor& step, const at::Tensor& lr, double beta1,
                         double beta2, double eps, double weight_decay, bool bias_correction,
                         bool grad_averaging, bool reg_inside_moment, int64_t norm_type,
                         bool init_zero, const c10::optional<at::Tensor>& grad_scale,
                         const c10::optional<at::Tensor>& found_inf, bool write_unscaled_grads,
                         const c10::optional<at::Tensor>& tensor_reductions,
                         c10::string_view part, c10::string_view master_mode,
                         at::IntArrayRef param_ids, int64_t seed);
// FP8 (csrc/ops/fp8.cpp, csrc/ops/fp8_gemm.cpp).
at::Tensor fp8_cast_amax_cuda(const at::Tensor& input, const at::Tensor& scale,
                              const at::Tensor& amax, at::ScalarType dtype);
void fp8_update_scales_cuda(at::TensorList amaxes, at::TensorList amax_histories,
                            at::TensorList scales, at::TensorList scale_invs,
                            at::ArrayRef<double> fp8_maxes, std::int64_t margin,
                            c10::string_view amax_compute,
                            const c10::optional<at::Tensor>& found_inf);
at::Tensor fp8_gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                         const at::Tensor& b_scale_inv, const c10::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype);
at::Tensor fp8_transpose_cuda(const at::Tensor& input);
#endif

}  // namespace ampfuse::ops
