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

from ampfuse.scaling.global_norm import l2norm_on_each_device


def check_max_grad_norm(value):
    if isinstance(value, bool) or not (0.0 <= float(value) < math.inf):
        raise ValueError(f"FusedAdam: max_grad_norm={value!r}; it must be a finite number >= 0 "
                         "(0 turns the clipping off).")
    return float(value)


class GroupNormClipMixin:
    """For a FusedOptimizer whose groups may carry 'max_grad_norm' (> 0: clip that group). The
    subclass's __init__ calls _init_clip() before FusedOptimizer's."""

    def _init_clip(self):
        # param group index -> ({device: its grads' norm}, its max_grad_norm), refilled at every
        # step rather than replaced, as FusedLAMB's norms (torch.compile traces step() whole).
        self._clip_divisors = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_clip_divisors", {})

    def _before_launches(self, plans):
        super()._before_launches(plans)
        self._clip_divisors.clear()
        for index, group, calls in plans:
            max_norm = float(group.get("max_grad_norm", 0.0))
            by_device = {}
            for call in calls:
                if call.grads:
                    by_device.setdefault(call.step.device, []).extend(call.grads)
            if max_norm > 0.0 and by_device:
                self._clip_divisors[index] = (l2norm_on_each_device(by_device), max_norm)

    def _launch(self, group, call, lr, grad_scale, found_inf):
        clip = None
        if self._clip_divisors:
            for index, candidate in enumerate(self.param_groups):
                if candidate is group:
                    clip = self._clip_divisors.get(index)
                    break
        if clip is not None:
            norms, max_norm = clip
            device = call.step.device
            scale = (torch.ones((), device=device) if grad_scale is None
                     else grad_scale.reshape(()).to(device))
            ratio = (norms[device].reshape(()) / scale + 1e-6) / max_norm
            grad_scale = (scale * torch.where(ratio > 1.0, ratio, 1.0)).reshape(1)
        super()._launch(group, call, lr, grad_scale, found_inf)
