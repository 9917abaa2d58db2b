"""Fused SGD step over tensor lists: typed wrapper and fake kernel (C++ in csrc/ops/sgd.cpp).
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


def fused_sgd_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    momentum_buffers: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
    step: torch.Tensor, lr: float | torch.Tensor, momentum: float = 0.0,
    dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
    maximize: bool = False, grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None, write_unscaled_grads: bool = False,
    wd_after_momentum: bool = False, master_mode: str = "fp32", param_ids: Iterable[int] = (),
    seed: int = 0,
) -> None:
    """One SGD step over lists (see the op's schema in csrc/registration.cpp).

    lr is a float or a one-element float32 tensor on the params' device; write_unscaled_grads
    and the master modes as for fused_adam_; wd_after_momentum adds the weight decay to the
    update after the momentum step (apex's option) instead of to the grad before it."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_sgd_(
        list(params), list(grads), list(momentum_buffers), list(master_params), step, lr,
        momentum, dampening, weight_decay, nesterov, maximize, grad_scale, found_inf,
        write_unscaled_grads, wd_after_momentum, master_mode, list(param_ids), seed,
    )


@torch.library.register_fake("ampfuse::fused_sgd_")
def _sgd_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
    step: torch.Tensor, lr: torch.Tensor, momentum: float, dampening: float,
    weight_decay: float, nesterov: bool, maximize: bool, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, write_unscaled_grads: bool = False,
    wd_after_momentum: bool = False, master_mode: str = "fp32", param_ids: Sequence[int] = (),
    seed: int = 0,
) -> None:
    op = "fused_sgd_"
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_companions(op, params, "momentum_buffers", momentum_buffers, True, True)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
