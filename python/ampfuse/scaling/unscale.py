"""Unscaling an optimizer's gradients and checking them for inf/nan: which op takes which grad.

``GradScaler._unscale_grads_`` (torch's hook, same signature and result) lands here. Every
gradient torch.amp.GradScaler accepts is accepted, through one of two paths:

- fp32, fp16 and bf16 grads on the CPU or on CUDA (the usual case, in any layout: the op
  writes a strided slice through a contiguous copy, which does not round) go to
  ``ampfuse.multi_tensor_unscale_``: one call per device for all of them, whatever their
  dtypes;
- float64 grads, and grads on devices ampfuse has no kernels for, go to
  ``torch._amp_foreach_non_finite_check_and_unscale_`` grouped by device and dtype, the op
  torch's GradScaler itself uses, so they come out as with torch, bit for bit.

A complex grad takes the path of its real view (complex64 ours, complex128 torch's op); torch's
GradScaler refuses complex grads (its op has no complex kernel), so a model with complex params
can use loss scaling here, with the fused optimizers (which step complex64 params) or torch's.

All paths set the same per-device flag. Nothing is read back to the host. With a
``CheckRecord`` (``GradScaler(attribute_overflow=True)``), the kernels also flag which grads held
inf/nan (see ``ampfuse.overflow``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ampfuse import ops
from ampfuse.ops import HELD_INF, HELD_NAN
from ampfuse.overflow import CheckRecord, param_name

__all__ = ["unscale_grads_", "cuda_kernels_usable"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TORCH_DTYPES = (torch.float64,)
_COMPLEX_DTYPES = (torch.complex64, torch.complex128)

# A grad to unscale and where it is: (grad, (group index, param index, param)).
_Entry = tuple[torch.Tensor, tuple[int, int, torch.Tensor]]


@functools.cache
def cuda_kernels_usable() -> bool:
    # Fixed for the life of the process; asked once rather than at every step.
    return ops.cuda_available()


def _has_kernels(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and cuda_kernels_usable())


def _fp16_refused(name: str) -> ValueError:
    return ValueError(
        f"ampfuse.GradScaler: Attempting to unscale FP16 gradients ({name} has an fp16 grad). "
        "Dividing a scaled fp16 gradient in place flushes its small components to zero. Keep "
        "the params in fp32 (torch.autocast computes in fp16), use bf16, or use an ampfuse "
        "fused optimizer (FusedAdam, FusedSGD): scaler.step() then only checks the grads and "
        "the optimizer divides the scale out in fp32."
    )


def _collect(
    optimizer: torch.optim.Optimizer, allow_fp16: bool
) -> tuple[dict[torch.device, list[_Entry]], dict[tuple[torch.device, torch.dtype], list[_Entry]]]:
    """The grads to unscale, sorted into the two paths of the module docstring, with the
    checks torch makes (fp16, sparse) and a clear error for dtypes no scaler takes. Each path
    maps to a list of (grad, (group index, param index, param)) entries."""
    ours: dict[torch.device, list[_Entry]] = {}  # device -> entries
    theirs: dict[tuple[torch.device, torch.dtype], list[_Entry]] = {}  # (device, dtype) -> entries
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if not allow_fp16 and grad.dtype == torch.float16:
                raise _fp16_refused(param_name(group_index, param_index))
            if grad.is_sparse:
                # Duplicate indices of an uncoalesced fp16 grad may overflow once summed, so
                # those are checked summed (torch does the same).
                if grad.dtype == torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            if grad.dtype in _COMPLEX_DTYPES:
                # Real and imaginary parts side by side: the same numbers, in a dtype the ops
                # take (torch's own unscale op has no complex kernel).
                grad = torch.view_as_real(grad)
            entry = (grad, (group_index, param_index, param))
            if grad.dtype in _KERNEL_DTYPES and _has_kernels(grad.device):
                ours.setdefault(grad.device, []).append(entry)
            elif grad.dtype in _KERNEL_DTYPES or grad.dtype in _TORCH_DTYPES:
                theirs.setdefault((grad.device, grad.dtype), []).append(entry)
            else:
                raise ValueError(
                    f"ampfuse.GradScaler: {param_name(group_index, param_index)} has a "
                    f"{grad.dtype} gradient; gradient scaling takes torch.float32, "
                    "torch.float16, torch.bfloat16 and torch.float64 gradients (as "
                    "torch.amp.GradScaler does), and complex64/complex128 ones."
                )
    return ours, theirs


def _torch_flags(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """HELD_INF | HELD_NAN per grad, for the grads torch's op unscales (float64, other devices):
    that op has no per-tensor output, so these take one more read with torch's own ops."""
    held = [g.isinf().any().int() * HELD_INF + g.isnan().any().int() * HELD_NAN for g in grads]
    return torch.stack(held).to(torch.int32)


def unscale_grads_(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                   found_inf: torch.Tensor, allow_fp16: bool,
                   record: CheckRecord | None = None) -> dict[torch.device, torch.Tensor]:
    """Multiplies every grad of `optimizer` by `inv_scale` in place (1.0 only checks) and
    returns {device: flag}: a copy of `found_inf` on each device that holds grads, set to 1 if
    any of that device's grads holds inf/nan. torch.amp.GradScaler._unscale_grads_'s contract.
    fp16 grads raise unless allow_fp16.

    record: an ampfuse.overflow.CheckRecord to fill with which grads held inf/nan; the kernels
    write those flags in the pass they make anyway."""
    ours, theirs = _collect(optimizer, allow_fp16)
    # device -> (found_inf, inv_scale) there
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in per_device:
            per_device[device] = (
                found_inf.to(device=device, dtype=torch.float32, non_blocking=True, copy=True),
                inv_scale.to(device=device, dtype=torch.float32, non_blocking=True),
            )
        return per_device[device]

    with torch.no_grad():
        for device, entries in ours.items():
            flag, factor = on(device)
            grads = [g for g, _ in entries]
            tensor_flags: torch.Tensor | None = None
            if record is not None:
                tensor_flags = torch.zeros(len(grads), dtype=torch.int32, device=device)
                record.add([where for _, where in entries], tensor_flags)
            ops.multi_tensor_unscale_(grads, flag, factor, tensor_flags)
        for (device, _), entries in theirs.items():
            flag, factor = on(device)
            grads = [g for g, _ in entries]
            if record is not None:
                record.add([where for _, where in entries], _torch_flags(grads))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, factor)
    flags = {device: flags[0] for device, flags in per_device.items()}
    if record is not None:
        record.set_verdict(*flags.values())
    return flags
