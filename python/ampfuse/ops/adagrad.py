"""Typed wrapper and fake (meta) kernel of fused_adagrad_ (schema in csrc/registration.cpp).
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


def fused_adagrad_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    state_sums: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
    step: torch.Tensor, lr: float | torch.Tensor, lr_decay: float = 0.0,
    weight_decay: float = 0.0, eps: float = 1e-10, decoupled_weight_decay: bool = False,
    maximize: bool = False, grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None, write_unscaled_grads: bool = False,
    master_mode: str = "fp32", param_ids: Iterable[int] = (), seed: int = 0,
) -> None:
    """One Adagrad step over lists, in torch.optim.Adagrad's math (decoupled_weight_decay:
    apex.optimizers.FusedAdagrad's adagrad_w_mode). state_sums are fp32 running sums of squared
    grads; lr, grad_scale, found_inf, write_unscaled_grads and the master modes (master_mode,
    param_ids, seed) as for fused_adam_."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_adagrad_(
        list(params), list(grads), list(state_sums), list(master_params), step, lr, lr_decay,
        weight_decay, eps, decoupled_weight_decay, maximize, grad_scale, found_inf,
        write_unscaled_grads, master_mode, list(param_ids), seed,
    )


@torch.library.register_fake("ampfuse::fused_adagrad_")
def _adagrad_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
    step: torch.Tensor, lr: torch.Tensor, lr_decay: float, weight_decay: float, eps: float,
    decoupled_weight_decay: bool, maximize: bool, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, write_unscaled_grads: bool = False,
    master_mode: str = "fp32", param_ids: Sequence[int] = (), seed: int = 0,
) -> None:
    op = "fused_adagrad_"
    for name, value in (("lr_decay", lr_decay), ("weight_decay", weight_decay), ("eps", eps)):
        if not value >= 0.0:
            raise RuntimeError(f"ampfuse.{op}: {name} must be >= 0, got {value}.")
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_companions(op, params, "state_sums", state_sums, fp32_only=True, optional=False)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
