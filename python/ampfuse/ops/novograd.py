"""Typed wrapper and fake (meta) kernel of fused_novograd_ (schema in csrc/registration.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.ops._checks import (
    check_companions,
    check_list,
    check_master_mode,
    check_scalar,
    check_step_scalars,
    lr_tensor,
)
from ampfuse.ops._dtensor_hook import register_dtensor_rules
from ampfuse.ops import _library  # noqa: F401  (registers the ops first)

NOVOGRAD_PARTS = ("both", "norms", "apply")
NORM_TYPES = (2, 0)  # apex's: 2 is the L2 norm, 0 the max (infinity) norm


def fused_novograd_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    exp_avgs: Iterable[torch.Tensor], norm_avgs: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor], step: torch.Tensor, lr: float | torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction: bool = True,
    grad_averaging: bool = True, reg_inside_moment: bool = False, norm_type: int = 2,
    init_zero: bool = False, grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None, write_unscaled_grads: bool = False,
    tensor_reductions: torch.Tensor | None = None, part: str = "both",
    master_mode: str = "fp32", param_ids: Iterable[int] = (), seed: int = 0,
) -> None:
    """One NovoGrad step over lists, in apex.optimizers.FusedNovoGrad's math.

    norm_avgs holds each param's running grad norm (a one-element float32 tensor, 0 before the
    first step); norm_type is 2 (L2) or 0 (max). lr, grad_scale, found_inf and
    write_unscaled_grads as for fused_adam_. part="norms" reduces each tensor's unscaled grads
    alone (sum of squares, or max |g|) into tensor_reductions (torch.float64, shape
    (len(params),)); part="apply" blends the running norms from them, updates the params and
    advances step. For DTensor params (FSDP2) ampfuse.ops.dtensor runs the two halves with the
    reductions combined over the shards in between. The master modes (master_mode, param_ids,
    seed) as for fused_adam_; a bf16 mode changes the second half only (the first reads only
    the grads), but both halves take the same arguments."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_novograd_(
        list(params), list(grads), list(exp_avgs), list(norm_avgs), list(master_params), step,
        lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment,
        norm_type, init_zero, grad_scale, found_inf, write_unscaled_grads, tensor_reductions,
        part, master_mode, list(param_ids), seed,
    )


@torch.library.register_fake("ampfuse::fused_novograd_")
def _novograd_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor], norm_avgs: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor], step: torch.Tensor, lr: torch.Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, bias_correction: bool, grad_averaging: bool,
    reg_inside_moment: bool, norm_type: int, init_zero: bool, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, write_unscaled_grads: bool = False,
    tensor_reductions: torch.Tensor | None = None, part: str = "both",
    master_mode: str = "fp32", param_ids: Sequence[int] = (), seed: int = 0,
) -> None:
    op = "fused_novograd_"
    if part not in NOVOGRAD_PARTS:
        raise RuntimeError(f"ampfuse.{op}: part={part!r} is not one of 'both', 'norms', 'apply'.")
    if norm_type not in NORM_TYPES:
        raise RuntimeError(
            f"ampfuse.{op}: norm_type={norm_type} is not supported; use 2 (the L2 norm) or 0 "
            "(the max norm), as apex.optimizers.FusedNovoGrad."
        )
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_companions(op, params, "exp_avgs", exp_avgs, fp32_only=True, optional=False)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
    if len(norm_avgs) != len(params):
        raise RuntimeError(
            f"ampfuse.{op}: norm_avgs has {len(norm_avgs)} tensors but params has {len(params)}; "
            "pass one running grad norm (a one-element float32 tensor) per param."
        )
    for i, t in enumerate(norm_avgs):
        check_scalar(op, f"norm_avgs[{i}]", t, torch.float32, device, "params")
    home = device or step.device
    if tensor_reductions is None and part != "both":
        raise RuntimeError(
            f"ampfuse.{op}: part='norms' and part='apply' pass each tensor's grad reduction "
            f"through tensor_reductions; give a torch.float64 tensor of shape ({len(params)},)."
        )
    if tensor_reductions is not None and (
        tensor_reductions.dtype != torch.float64
        or tuple(tensor_reductions.shape) != (len(params),)
        or tensor_reductions.device != home
    ):
        raise RuntimeError(
            f"ampfuse.{op}: tensor_reductions must be a contiguous torch.float64 tensor of shape "
            f"({len(params)},) on {home}, got {tensor_reductions.dtype} of shape "
            f"{tuple(tensor_reductions.shape)} on {tensor_reductions.device}."
        )
