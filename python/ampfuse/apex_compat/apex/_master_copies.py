"""The master-param copies of apex.fp16_utils (re-exported there under apex's names), in a
module of their own so that FP16_Optimizer, which fp16_utils also exports, uses them without
importing fp16_utils back."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampfuse import ops


def model_grads_to_master_grads(model_params, master_params, flat_master=False):
    """Copies the model's grads into the masters' (fp32) in one fused op; a param without a
    grad leaves its master without one."""
    if flat_master:
        master_params[0].grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    src, dst = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad)
        dst.append(master.grad)
    _copy(src, dst)


def master_params_to_model_params(model_params, master_params, flat_master=False):
    """Copies the masters into the model's params (rounded to their dtype) in one fused op."""
    if flat_master:
        masters = _unflatten_dense_tensors(master_params[0].detach(), model_params)
    else:
        masters = [m.detach() for m in master_params]
    _copy(masters, [p.data for p in model_params])


def _copy(src, dst):
    """dst[i] = src[i] in dst's dtype, one multi-tensor op per device (scale 1)."""
    by_device = {}
    for s, d in zip(src, dst):
        pair = by_device.setdefault(d.device, ([], []))
        pair[0].append(s)
        pair[1].append(d)
    for device, (s, d) in by_device.items():
        ops.multi_tensor_scale_(s, d, torch.ones(1, device=device),
                                 torch.zeros(1, device=device))
