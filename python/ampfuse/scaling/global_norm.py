"""The L2 norm of a set of tensors spread over several devices, with no host sync: what
FusedLAMB's clip, the apex alias's FusedAdam(max_grad_norm=...) and its
apex.contrib.clip_grad all need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ampfuse import ops


def l2norm_on_each_device(
    by_device: Mapping[torch.device, Sequence[torch.Tensor]]
) -> dict[torch.device, torch.Tensor]:
    """{device: tensors} -> {device: the L2 norm of every tensor of every device}, each a
    float32 tensor on its device: one fused multi_tensor_l2norm per device, and with several
    devices their squares summed on the first and the total copied back to each."""
    norms = {device: ops.multi_tensor_l2norm(tensors, False)[0]
             for device, tensors in by_device.items()}
    if len(norms) > 1:
        home = next(iter(norms))
        squares = [norm.to(home, non_blocking=True).square() for norm in norms.values()]
        total = torch.stack(squares).sum().sqrt()
        norms = {device: total.to(device, non_blocking=True) for device in norms}
    return norms
