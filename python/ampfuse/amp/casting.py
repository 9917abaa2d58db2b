"""How amp changes the precision a model computes in, without replacing torch functions or a
model's forward:

- O1 (per_op.py): forward hooks enter torch.autocast for the model's forward, together with a
  TorchFunctionMode that enforces ampfuse's fp32 list and the model's custom lists, down into
  the torch functions that other torch functions call.
- O2/O3 (here): the model's parameters and buffers are cast to the low dtype except, when asked,
  normalization layers, which stay fp32 and get hooks that run them on fp32 inputs and hand
  low-precision outputs on.
- Inputs and outputs are cast at the model's boundary by forward hooks.
"""

from __future__ import annotations

import torch

# amp.initialize reaches the O1 pieces through this module.
from ampfuse.amp.per_op import (  # noqa: F401
    FP32_FUNCTIONS,
    AutocastHooks,
    CastLists,
    CastMode,
    cast_decorator,
    check_custom_lists,
)
from ampfuse.amp.tensor_casts import cast_floats

NORM_TYPES = (
    torch.nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d and SyncBatchNorm
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


def cast_model(model: torch.nn.Module, dtype: torch.dtype, keep_norm_fp32: bool):
    """Casts floating parameters and buffers to `dtype` in place (the Parameter objects stay
    the same, so optimizers keep pointing at them). With keep_norm_fp32, normalization layers
    stay fp32 and get hooks that feed them fp32 inputs and hand `dtype` outputs on. Returns the
    hook handles."""
    handles = []
    for module in model.modules():
        if keep_norm_fp32 and isinstance(module, NORM_TYPES):
            handles.append(module.register_forward_pre_hook(
                lambda m, args: cast_floats(args, torch.float32)))
            handles.append(module.register_forward_hook(
                lambda m, args, out, dtype=dtype: cast_floats(out, dtype)))
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
    return handles


def cast_model_io(model, input_dtype, output_dtype):
    """Hooks casting the model's floating inputs to input_dtype and outputs to output_dtype
    (either may be None)."""
    handles = []
    if input_dtype is not None:
        handles.append(model.register_forward_pre_hook(
            lambda m, args, kwargs: (cast_floats(args, input_dtype),
                                     cast_floats(kwargs, input_dtype)),
            with_kwargs=True))
    if output_dtype is not None:
        handles.append(model.register_forward_hook(
            lambda m, args, out: cast_floats(out, output_dtype)))
    return handles
