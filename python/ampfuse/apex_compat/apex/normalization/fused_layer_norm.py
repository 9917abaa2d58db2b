"""apex.normalization.fused_layer_norm on torch's layer_norm and rms_norm.

The modules are torch.nn.LayerNorm and torch.nn.RMSNorm with apex's constructors, so amp
treats them as the norm layers they are (O2 keeps them fp32). The functions keep apex's
dtype contract: under autocast the inputs are cast to the autocast dtype, the statistics are
computed in fp32, and the result has the input's dtype (the Mixed variants: the weight's).
apex's memory_efficient (recompute instead of store in backward) is accepted and changes
nothing in the result.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
           "fused_layer_norm", "fused_layer_norm_affine", "fused_rms_norm",
           "fused_rms_norm_affine", "mixed_dtype_fused_layer_norm_affine",
           "mixed_dtype_fused_rms_norm_affine"]


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _autocast_inputs(device_type, *tensors):
    """apex casts a fused norm's inputs to the autocast dtype and then runs with autocast off."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _norm(kind, input, weight, bias, normalized_shape, eps, out_dtype=None):
    device_type = input.device.type
    input, weight, bias = _autocast_inputs(device_type, input, weight, bias)
    out_dtype = out_dtype or input.dtype
    wide = [t.float() if t is not None else None for t in (input, weight, bias)]
    with torch.autocast(device_type, enabled=False):
        if kind == "layer":
            out = F.layer_norm(wide[0], _shape(normalized_shape), wide[1], wide[2], eps)
        else:
            out = F.rms_norm(wide[0], _shape(normalized_shape), wide[1], eps)
    return out.to(out_dtype)


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                            memory_efficient=False):
    return _norm("layer", input, weight, bias, normalized_shape, eps)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("layer", input, None, None, normalized_shape, eps)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("rms", input, weight, None, normalized_shape, eps)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm("rms", input, None, None, normalized_shape, eps)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    return _norm("layer", input, weight, bias, normalized_shape, eps, out_dtype=weight.dtype)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    return _norm("rms", input, weight, None, normalized_shape, eps, out_dtype=weight.dtype)


class FusedLayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm with apex's constructor (normalized_shape, eps=1e-5,
    elementwise_affine=True, memory_efficient=False)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with apex's constructor (normalized_shape, eps=1e-5,
    elementwise_affine=True, memory_efficient=False); apex's eps default, not torch's."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient


def _always_affine(name, kwargs):
    unknown = set(kwargs) - {"elementwise_affine"}
    if unknown:
        raise TypeError(f"{name}: unexpected arguments {sorted(unknown)}.")
    if not kwargs.get("elementwise_affine", True):
        raise ValueError(f"{name} always has a weight (apex refuses elementwise_affine=False "
                         "too); use FusedLayerNorm / FusedRMSNorm for a norm without one.")


class MixedFusedLayerNorm(FusedLayerNorm):
    """apex's MixedFusedLayerNorm: always affine, and the output takes the weight's dtype
    (fp32 weights give fp32 outputs from low-precision inputs)."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _always_affine(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input):
        return mixed_dtype_fused_layer_norm_affine(input, self.weight, self.bias,
                                                   self.normalized_shape, self.eps)


class MixedFusedRMSNorm(FusedRMSNorm):
    """apex's MixedFusedRMSNorm: always affine, output in the weight's dtype."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _always_affine(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input):
        return mixed_dtype_fused_rms_norm_affine(input, self.weight, self.normalized_shape,
                                                 self.eps)
