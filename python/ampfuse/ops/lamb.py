"""Typed wrappers and fake (meta) kernels of fused_lamb_ and fused_lamb_coded_ (schemas in
csrc/registration.cpp).
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
    check_scalar,
    check_state_dtype,
    check_step_scalars,
    lr_tensor,
)
from ampfuse.ops._dtensor_hook import register_dtensor_rules


def fused_lamb_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    exp_avgs: Iterable[torch.Tensor], exp_avg_sqs: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor], step: torch.Tensor, lr: float | torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float, adam_w_mode: bool = True,
    bias_correction: bool = True, grad_averaging: bool = True, use_nvlamb: bool = False,
    max_grad_norm: float = 0.0, grad_norm: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    write_unscaled_grads: bool = False, tensor_sums: torch.Tensor | None = None,
    part: str = "both", master_mode: str = "fp32", param_ids: Iterable[int] = (),
    seed: int = 0,
) -> None:
    """One LAMB step over lists, in apex.optimizers.FusedLAMB's math.

    grad_norm is the global L2 norm of every grad of the step as passed (still carrying
    grad_scale, which the op divides out), needed when max_grad_norm > 0; max_grad_norm=0 turns
    clipping off. lr, grad_scale, found_inf, write_unscaled_grads and the master modes
    (master_mode, param_ids, seed: bf16 params without fp32 masters) as for fused_adam_; both
    passes read the value a mode holds, and only the second writes the params.
    part="moments" runs the first pass alone and leaves each tensor's sums of squares of param
    and update in tensor_sums (torch.float64, shape (len(params), 2)); part="apply" runs the
    second pass from them and advances step. For DTensor params (FSDP2) ampfuse.ops.dtensor
    runs the two halves with the sums added over the shards in between."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_lamb_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(master_params), step,
        lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging,
        use_nvlamb, max_grad_norm, grad_norm, grad_scale, found_inf, write_unscaled_grads,
        tensor_sums, part, master_mode, list(param_ids), seed,
    )


def fused_lamb_coded_(
    params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
    exp_avg_codes: Iterable[torch.Tensor], exp_avg_scales: Iterable[torch.Tensor],
    exp_avg_sq_codes: Iterable[torch.Tensor], exp_avg_sq_scales: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor], step: torch.Tensor, lr: float | torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float, adam_w_mode: bool = True,
    bias_correction: bool = True, grad_averaging: bool = True, use_nvlamb: bool = False,
    max_grad_norm: float = 0.0, grad_norm: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    write_unscaled_grads: bool = False, tensor_sums: torch.Tensor | None = None,
    part: str = "both", *, state_dtype: str = "int8", master_mode: str = "fp32",
    param_ids: Iterable[int] = (), seed: int = 0,
) -> None:
    """fused_lamb_ with block-coded moments (FusedLAMB's state_dtype): bit for bit, decoding
    the moments, one fused_lamb_ step on them in fp32 and coding the new moments again.

    state_dtype "int8": exp_avg_codes torch.int8, exp_avg_sq_codes torch.uint8; "fp8": both
    torch.float8_e4m3fn. Each code tensor is shaped and laid out like its param; each scales
    tensor is fp32, 1-D, with one scale per block of 256 elements of the param in memory order
    (the format of ampfuse.optimizers._state_codes). Everything else as for fused_lamb_, but for
    the halves: the codes are written by the second pass, which forms the new moments again
    from the same codes and grads, so part="moments" writes only tensor_sums and part="apply"
    takes the grads (and grad_norm when clipping) too. DTensors are not taken: call it on each
    rank's local shards with part="moments", add tensor_sums over the shards, then
    part="apply" (FusedLAMB does)."""
    lr = lr_tensor(lr, step)
    register_dtensor_rules()
    torch.ops.ampfuse.fused_lamb_coded_(
        list(params), list(grads), list(exp_avg_codes), list(exp_avg_scales),
        list(exp_avg_sq_codes), list(exp_avg_sq_scales), list(master_params), step, lr, beta1,
        beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb,
        max_grad_norm, grad_norm, grad_scale, found_inf, write_unscaled_grads, tensor_sums, part,
        state_dtype=state_dtype, master_mode=master_mode, param_ids=list(param_ids), seed=seed,
    )


LAMB_PARTS = ("both", "moments", "apply")


@torch.library.register_fake("ampfuse::fused_lamb_")
def _lamb_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor], step: torch.Tensor, lr: torch.Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, adam_w_mode: bool, bias_correction: bool,
    grad_averaging: bool, use_nvlamb: bool, max_grad_norm: float,
    grad_norm: torch.Tensor | None, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, write_unscaled_grads: bool = False,
    tensor_sums: torch.Tensor | None = None, part: str = "both", master_mode: str = "fp32",
    param_ids: Sequence[int] = (), seed: int = 0,
) -> None:
    _check_lamb_call(
        "fused_lamb_", params, grads, master_params, step, lr, max_grad_norm, grad_norm,
        grad_scale, found_inf, tensor_sums, part, master_mode, param_ids,
        norm_needed=part != "apply",
    )
    check_companions("fused_lamb_", params, "exp_avgs", exp_avgs, fp32_only=True, optional=False)
    check_companions("fused_lamb_", params, "exp_avg_sqs", exp_avg_sqs, fp32_only=True,
                     optional=False)


def _check_lamb_call(
    op: str, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor], step: torch.Tensor, lr: torch.Tensor,
    max_grad_norm: float, grad_norm: torch.Tensor | None, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, tensor_sums: torch.Tensor | None, part: str,
    master_mode: str, param_ids: Sequence[int], norm_needed: bool,
) -> None:
    """The checks the fakes of fused_lamb_ and fused_lamb_coded_ share (all but the moments);
    norm_needed: whether this part forms the clipped grads (and so needs grad_norm)."""
    if part not in LAMB_PARTS:
        raise RuntimeError(
            f"ampfuse.{op}: part={part!r} is not one of 'both', 'moments', 'apply'."
        )
    if not (max_grad_norm >= 0.0 and max_grad_norm != float("inf")):
        raise RuntimeError(
            f"ampfuse.{op}: max_grad_norm must be a finite number >= 0 (0 turns clipping off), "
            f"got {max_grad_norm}."
        )
    if max_grad_norm > 0.0 and grad_norm is None and norm_needed:
        raise RuntimeError(
            f"ampfuse.{op}: max_grad_norm={max_grad_norm} clips by the global grad norm; pass it "
            "as grad_norm, or max_grad_norm=0 for no clipping."
        )
    device = check_list(op, "params", params)
    check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    check_master_mode(op, params, master_params, master_mode, param_ids)
    check_step_scalars(op, device, step, lr, grad_scale, found_inf)
    if max_grad_norm > 0.0 and norm_needed:
        owner = "params" if device is not None else "step, as params is empty"
        check_scalar(op, "grad_norm", grad_norm, torch.float32, device or step.device, owner)
    if tensor_sums is None and part != "both":
        raise RuntimeError(
            f"ampfuse.{op}: part='moments' and part='apply' pass each tensor's sums of squares "
            f"through tensor_sums; give a torch.float64 tensor of shape ({len(params)}, 2)."
        )
    if tensor_sums is not None and (
        tensor_sums.dtype != torch.float64 or tuple(tensor_sums.shape) != (len(params), 2)
        or tensor_sums.device != (device or step.device)
    ):
        raise RuntimeError(
            f"ampfuse.{op}: tensor_sums must be a contiguous torch.float64 tensor of shape "
            f"({len(params)}, 2) on {device or step.device}, got {tensor_sums.dtype} of shape "
            f"{tuple(tensor_sums.shape)} on {tensor_sums.device}."
        )


@torch.library.register_fake("ampfuse::fused_lamb_coded_")
def _lamb_coded_fake(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avg_codes: Sequence[torch.Tensor], exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_codes: Sequence[torch.Tensor], exp_avg_sq_scales: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor], step: torch.Tensor, lr: torch.Tensor, beta1: float,
    beta2: float, eps: float, weight_decay: float, adam_w_mode: bool, bias_correction: bool,
    grad_averaging: bool, use_nvlamb: bool, max_grad_norm: float,
    grad_norm: torch.Tensor | None, grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None, write_unscaled_grads: bool = False,
    tensor_sums: torch.Tensor | None = None, part: str = "both", *, state_dtype: str = "int8",
    master_mode: str = "fp32", param_ids: Sequence[int] = (), seed: int = 0,
) -> None:
    op = "fused_lamb_coded_"
    check_state_dtype(op, state_dtype, "fused_lamb_")
    # Every part of the coded step forms the clipped moments, so each needs grad_norm.
    _check_lamb_call(op, params, grads, master_params, step, lr, max_grad_norm, grad_norm,
                     grad_scale, found_inf, tensor_sums, part, master_mode, param_ids,
                     norm_needed=True)
    for codes_name, codes, scales_name, scales, second in (
        ("exp_avg_codes", exp_avg_codes, "exp_avg_scales", exp_avg_scales, False),
        ("exp_avg_sq_codes", exp_avg_sq_codes, "exp_avg_sq_scales", exp_avg_sq_scales, True),
    ):
        check_coded_moment(op, params, codes_name, codes, scales_name, scales, state_dtype,
                           second, False)
