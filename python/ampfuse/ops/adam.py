"""Fused Adam/AdamW step over tensor lists: typed wrapper and fake kernel (C++ in
csrc/ops/adam.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.ops import _library  # noqa: F401  (registers the ops first)
from ampfuse.ops._checks import (
    check_coded_moment,
    check_companions,
    check_list,
    check_master_mode,
    check_state_dtype,
    check_step_scalars,
    lr_tensor,
)
from ampfuse.ops._dtensor_hook import register_dtensor_rules


def fused_adam_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    exp_avgs: Iterable[torch.Tensor], exp_avg_sqs: Iterable[torch.Tensor],
    max_exp_avg_sqs: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
    step: torch.Tensor, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float,
    weight_decay: float, adam_w_mode: bool = True, bias_correction: bool = True,
    amsgrad: bool = False, maximize: bool = False, grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None, write_unscaled_grads: bool = False,
    master_mode: str = "fp32", param_ids: Iterable[int] = (), seed: int = 0,
) -> None:
    """One Adam/AdamW step over lists (see the op's schema in csrc/registration.cpp).

    lr is a float or a one-element float32 tensor on the params' device. With
    write_unscaled_grads and a grad_scale, the grads are left divided by grad_scale (unless the
    step is skipped), as torch's fused optimizers leave them. master_mode "stochastic",
    "kahan" or "split" updates bf16 params without fp32 masters (master_params: none, bf16
    compensations, int16 low halves; param_ids and seed key the stochastic rounding)."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_adam_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
        list(master_params), step, lr, beta1, beta2, eps, weight_decay, adam_w_mode,
        bias_correction, amsgrad, maximize, grad_scale, found_inf, write_unscaled_grads,
        master_mode, list(param_ids), seed,
    )


@torch.library.register_fake("ampfuse::fused_adam_")
def _adam_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
    step: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, eps: float,
    weight_decay: float, adam_w_mode: bool, bias_correction: bool, amsgrad: bool,
    maximize: bool, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
    write_unscaled_grads: bool = False, master_mode: str = "fp32",
    param_ids: Sequence[int] = (), seed: int = 0,
) -> None:
    op = "fused_adam_"
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_companions(op, params, "exp_avgs", exp_avgs, fp32_only=True, optional=False)
    check_companions(op, params, "exp_avg_sqs", exp_avg_sqs, fp32_only=True, optional=False)
    check_companions(op, params, "max_exp_avg_sqs", max_exp_avg_sqs, True, not amsgrad)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)


def fused_adam_coded_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    exp_avg_codes: Iterable[torch.Tensor], exp_avg_scales: Iterable[torch.Tensor],
    exp_avg_sq_codes: Iterable[torch.Tensor], exp_avg_sq_scales: Iterable[torch.Tensor],
    max_exp_avg_sq_codes: Iterable[torch.Tensor], max_exp_avg_sq_scales: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor], step: torch.Tensor, lr: float | torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float, adam_w_mode: bool = True,
    bias_correction: bool = True, amsgrad: bool = False, maximize: bool = False,
    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None, *,
    write_unscaled_grads: bool = True, state_dtype: str = "int8", master_mode: str = "fp32",
    param_ids: Iterable[int] = (), seed: int = 0,
) -> None:
    """One Adam/AdamW step with the moments held as 8-bit block codes, decoded, stepped and
    coded again in one pass (see the op's schema in csrc/registration.cpp).

    state_dtype "int8" or "fp8" is the format of ampfuse.optimizers._state_codes: codes shaped
    and laid out like their param (int8: exp_avg torch.int8, the second moments torch.uint8;
    fp8: all torch.float8_e4m3fn) and one fp32 scale per block of 256 elements in memory order.
    Every param needs at least 256 elements (smaller ones keep fp32 moments: fused_adam_). The
    result is bit for bit that of dequantize_moment -> fused_adam_ -> quantize_moment; all
    other arguments as for fused_adam_."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_adam_coded_(
        list(params), list(grads), list(exp_avg_codes), list(exp_avg_scales),
        list(exp_avg_sq_codes), list(exp_avg_sq_scales), list(max_exp_avg_sq_codes),
        list(max_exp_avg_sq_scales), list(master_params), step, lr, beta1, beta2, eps,
        weight_decay, adam_w_mode, bias_correction, amsgrad, maximize, grad_scale, found_inf,
        write_unscaled_grads=write_unscaled_grads, state_dtype=state_dtype,
        master_mode=master_mode, param_ids=list(param_ids), seed=seed,
    )


@torch.library.register_fake("ampfuse::fused_adam_coded_")
def _adam_coded_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avg_codes: Sequence[torch.Tensor], exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_codes: Sequence[torch.Tensor], exp_avg_sq_scales: Sequence[torch.Tensor],
    max_exp_avg_sq_codes: Sequence[torch.Tensor], max_exp_avg_sq_scales: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor], step: torch.Tensor, lr: torch.Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, adam_w_mode: bool, bias_correction: bool,
    amsgrad: bool, maximize: bool, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, *, write_unscaled_grads: bool = True,
    state_dtype: str = "int8", master_mode: str = "fp32", param_ids: Sequence[int] = (),
    seed: int = 0,
) -> None:
    op = "fused_adam_coded_"
    check_state_dtype(op, state_dtype, "fused_adam_")
    if not amsgrad and (len(max_exp_avg_sq_codes) or len(max_exp_avg_sq_scales)):
        raise RuntimeError(
            f"ampfuse.{op}: max_exp_avg_sq_codes and max_exp_avg_sq_scales must be empty when "
            "amsgrad is False."
        )
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    for codes_name, codes, scales_name, scales, second, optional in (
        ("exp_avg_codes", exp_avg_codes, "exp_avg_scales", exp_avg_scales, False, False),
        ("exp_avg_sq_codes", exp_avg_sq_codes, "exp_avg_sq_scales", exp_avg_sq_scales, True,
         False),
        ("max_exp_avg_sq_codes", max_exp_avg_sq_codes, "max_exp_avg_sq_scales",
         max_exp_avg_sq_scales, True, not amsgrad),
    ):
        check_coded_moment(op, params, codes_name, codes, scales_name, scales, state_dtype,
                           second, optional)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
