"""Fused Adam/AdamW step over tensor lists: typed wrapper and fake kernel (C++ in
csrc/ops/adam.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.ops._checks import (
    check_companions,
    check_list,
    check_master_mode,
    check_step_scalars,
    lr_tensor,
)
from ampfuse.ops._dtensor_hook import register_dtensor_rules
from ampfuse.ops import _library  # noqa: F401  (registers the ops first)


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
