"""apex.fp16_utils on ampfuse: the manual mixed-precision helpers apex shipped before amp
(FP16_Optimizer, the master-param copies, network_to_half), which apex's own ImageNet example
and the scripts copied from it import with ``from apex.fp16_utils import *``.

The copies and the unscale-with-overflow-check run as ampfuse's fused list ops (one launch for
all tensors, where apex looped or used its amp_C kernels); FP16_Optimizer's loss scale is an
ampfuse.scaling.LossScaler with apex's dynamic rule. Differences from apex: fp16 and bf16
params both get fp32 masters, on any device (apex took CUDA fp16 only), and state_dict() saves
the loss scale as a dict rather than a pickled scaler object (load_state_dict() takes either).
apex's module names (apex.fp16_utils.fp16util, .fp16_optimizer, .loss_scaler) are this module.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors

from ampfuse import ops
from ampfuse.apex_compat.apex._master_copies import (
    master_params_to_model_params,
    model_grads_to_master_grads,
)

__all__ = [
    "BN_convert_float", "DynamicLossScaler", "FP16Model", "FP16_Optimizer", "LossScaler",
    "clip_grad_norm", "convert_module", "convert_network", "master_params_to_model_params",
    "model_grads_to_master_grads", "network_to_half", "prep_param_lists", "to_python_float",
    "tofp16",
]

# A package to the import system, as apex.contrib.optimizers is (see there): an apex submodule
# the alias lacks then gets the alias's message, not "is not a package".
__path__ = []

clip_grad_norm = torch.nn.utils.clip_grad_norm_


def to_python_float(t):
    """A one-element tensor's value as a Python float (a host sync on a GPU tensor)."""
    return t.item() if hasattr(t, "item") else t[0]


# ---- models ---------------------------------------------------------------------------------

class tofp16(nn.Module):  # noqa: N801  (apex's name)
    """A module whose forward casts its input to fp16."""

    def forward(self, input):
        return input.half()


def _is_affine_batchnorm(module):
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine


def BN_convert_float(module):  # noqa: N802  (apex's name)
    """Puts every affine batch norm of `module` back in fp32 (their statistics need it)."""
    if _is_affine_batchnorm(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network):
    """fp16 model with fp32 affine batch norms, behind a module that casts its input."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module, dtype):
    """Converts the module's own floating params (and their grads) and buffers to `dtype`."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network, dtype):
    """Converts every module but the affine batch norms to `dtype`."""
    for module in network.modules():
        if _is_affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """The network in fp16 (affine batch norms kept fp32), its inputs cast to fp16."""

    def __init__(self, network):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*(t.half() for t in inputs))


# ---- master params --------------------------------------------------------------------------

def prep_param_lists(model, flat_master=False):
    """(model_params, master_params): the model's trainable params and fp32 copies of them
    (one flat fp32 tensor with a grad when flat_master)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise TypeError(
                "prep_param_lists(flat_master=True): the model's params have several dtypes "
                f"({sorted(str(p.dtype) for p in model_params)}); use flat_master=False or "
                "FP16_Optimizer.")
        flat = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        flat.grad = torch.empty_like(flat)
        return model_params, [flat]
    return model_params, [p.detach().clone().float().requires_grad_() for p in model_params]


# ---- apex's legacy loss scalers -------------------------------------------------------------

def _has_inf_or_nan(params):
    grads = [p.grad for p in params if p.grad is not None]
    found = {}
    for g in grads:
        found.setdefault(g.device, []).append(g)
    for device, tensors in found.items():
        flag = torch.zeros(1, device=device)
        ops.multi_tensor_nonfinite_check_(tensors, flag)
        if flag.item():
            return True
    return False


class LossScaler:
    """apex.fp16_utils.LossScaler: a static loss scale (`scale`), never overflowing."""

    def __init__(self, scale=1):
        self.cur_scale = scale

    def has_overflow(self, params):
        return False

    def update_scale(self, overflow):
        pass

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """apex.fp16_utils.DynamicLossScaler: the scale divides by scale_factor on an overflow (not
    below 1) and multiplies by it every scale_window iterations since the last one."""

    def __init__(self, init_scale=2**32, scale_factor=2.0, scale_window=1000):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params):
        """Whether any grad of `params` holds inf/nan: one fused check per device."""
        return _has_inf_or_nan(params)

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


# FP16_Optimizer lives beside this module; importing it here keeps apex's one namespace.
from ampfuse.apex_compat.apex._fp16_optimizer import FP16_Optimizer  # noqa: E402
