"""apex.contrib.clip_grad.clip_grad_norm_ on ampfuse: torch.nn.utils.clip_grad_norm_'s
signature and result, with the L2 norm of float grads taken by ampfuse's fused
multi_tensor_l2norm (one launch per device and dtype group, as apex's amp_C kernel did) and the
clip applied by multi_tensor_scale_, all on the device. Other norm types go to torch's."""

from __future__ import annotations

import torch

from ampfuse import ops
from ampfuse.scaling.global_norm import l2norm_on_each_device

__all__ = ["clip_grad_norm_"]

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scales the grads of `parameters` so that their total norm is at most max_norm; returns
    the total norm before clipping (a 0-dim float32 tensor on the first grad's device)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    if norm_type != 2.0 or any(g.dtype not in _FUSED_DTYPES or g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None],
                                              max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    by_device = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    norms = l2norm_on_each_device(by_device)
    total = norms[grads[0].device].reshape(())
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    # torch's rule: multiply by max_norm / (total + 1e-6), clamped at 1, with no host sync.
    for device, tensors in by_device.items():
        coef = torch.clamp(max_norm / (norms[device] + 1e-6), max=1.0).reshape(1)
        ops.multi_tensor_scale_(tensors, tensors, coef, torch.zeros(1, device=device))
    return total
