"""Fused SGD step over tensor lists: typed wrapper and fake kernel (C++ in csrc/ops/sgd.cpp).
"""

from __future__ import annotations

import torch

from ampfuse.ops._checks import (
    check_companions,
    check_list,
    check_master_mode,
    check_step_scalars,
    lr_tensor,
)
from ampfuse.ops._dtensor_hook import register_dtensor_rules
from ampfuse.ops._library import native  # noqa: F401  (registers the ops first)


def fused_sgd_(params, grads, momentum_buffers, master_params, step, lr, momentum=0.0,
               dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, grad_scale=None,
               found_inf=None, write_unscaled_grads=False, wd_after_momentum=False,
               master_mode="fp32", param_ids=(), seed=0) -> None:
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
def _sgd_fake(params, grads, momentum_buffers, master_params, step, lr, momentum, dampening,
              weight_decay, nesterov, maximize, grad_scale, found_inf, write_unscaled_grads=False,
              wd_after_momentum=False, master_mode="fp32", param_ids=(), seed=0):
    op = "fused_sgd_"
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_companions(op, params, "momentum_buffers", momentum_buffers, True, True)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
