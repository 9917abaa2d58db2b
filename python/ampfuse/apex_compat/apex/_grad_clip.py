"""apex 0.1's FusedAdam(max_grad_norm=...): each param group's grads clipped by their own global
L2 norm inside the step, as the BERT fine-tuning scripts of that era (pytorch-pretrained-BERT and
its descendants) construct it under FP16_Optimizer.

The divisor max(1, (||grads|| / scale + 1e-6) / max_grad_norm) is formed on the device and folded
into the grad scale the fused op divides out, so clipping costs one norm per group and no host
sync. A NaN norm (an overflow a scaler will skip) leaves the grads unclipped.
"""

from __future__ import annotations

import math

import torch

from ampfuse import _ops


def check_max_grad_norm(value):
    if isinstance(value, bool) or not (0.0 <= float(value) < math.inf):
        raise ValueError(f"FusedAdam: max_grad_norm={value!r}; it must be a finite number >= 0 "
                         "(0 turns the clipping off).")
    return float(value)


class GroupNormClipMixin:
    """For a FusedOptimizer whose groups may carry 'max_grad_norm' (> 0: clip that group). The
    subclass's __init__ calls _init_clip() before FusedOptimizer's."""

    def _init_clip(self):
        # param group index -> (its grads' norm, its max_grad_norm), refilled at every step
        # rather than replaced, as FusedLAMB's norms (torch.compile traces step() whole).
        self._clip_divisors = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_clip_divisors", {})

    def _before_launches(self, plans):
        super()._before_launches(plans)
        self._clip_divisors.clear()
        for index, group, calls in plans:
            max_norm = float(group.get("max_grad_norm", 0.0))
            grads = [g for call in calls for g in call.grads]
            if max_norm > 0.0 and grads:
                self._clip_divisors[index] = (_group_norm(grads), max_norm)

    def _launch(self, group, call, lr, grad_scale, found_inf):
        clip = None
        if self._clip_divisors:
            for index, candidate in enumerate(self.param_groups):
                if candidate is group:
                    clip = self._clip_divisors.get(index)
                    break
        if clip is not None:
            norm, max_norm = clip
            device = call.step.device
            scale = (torch.ones((), device=device) if grad_scale is None
                     else grad_scale.reshape(()).to(device))
            ratio = (norm.to(device) / scale + 1e-6) / max_norm
            grad_scale = (scale * torch.where(ratio > 1.0, ratio, 1.0)).reshape(1)
        super()._launch(group, call, lr, grad_scale, found_inf)


def _group_norm(grads):
    """The L2 norm of all `grads` (still carrying any loss scale), as a 0-dim fp32 tensor on the
    first grad's device: one fused norm per device, combined."""
    by_device = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = [_ops.multi_tensor_l2norm(tensors, False)[0].reshape(()) for tensors in
             by_device.values()]
    if len(norms) == 1:
        return norms[0]
    home = norms[0].device
    return torch.stack([n.to(home).square() for n in norms]).sum().sqrt()
