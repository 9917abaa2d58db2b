"""How amp changes the precision a model computes in, without replacing torch functions or a
model's forward:

- O1 (per_op.py): forward hooks enter torch.autocast for the model's forward and make the
  model's policy set active: ampfuse's fp32 list and the model's custom lists, as kernels on
  the Autocast dispatch keys of exactly the listed aten ops, so they hold inside composite
  torch functions too.
- O2/O3 (here): the model's parameters and buffers are cast to the low dtype except, when asked,
  normalization layers (every one torch ships, and the types given to register_norm_type),
  which stay fp32 with everything inside them, behind hooks that run them on fp32 inputs and
  hand low-precision outputs on. model.state_dict() gives what was cast back in the dtype it
  had before (fp32), as apex's O2 did, so checkpoints and exports load at any level.
- Inputs and outputs are cast at the model's boundary by forward hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

# (not in torch's parameter.pyi, but defined in torch/nn/parameter.py)
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]
from torch.utils.hooks import RemovableHandle

from ampfuse.amp import kept_norms
from ampfuse.amp.kept_norms import KeptNormForward

# amp.initialize reaches the O1 pieces through this module.
from ampfuse.amp.per_op import (  # noqa: F401
    FP32_FUNCTIONS,
    AutocastHooks,
    CastLists,
    cast_decorator,
    check_custom_lists,
)
from ampfuse.amp.tensor_casts import InputsTo, OutputsTo

NORM_TYPES = (
    torch.nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*
    torch.nn.modules.instancenorm._InstanceNorm,  # InstanceNorm1d/2d/3d, LazyInstanceNorm*
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    # No parameters, but their sums of squares lose as much in low precision as the others'.
    torch.nn.LocalResponseNorm,
    torch.nn.CrossMapLRN2d,
)

# Types added with register_norm_type, by the id of the handle that removes them (an
# OrderedDict, because the handle holds a weak reference to it). Process-wide like apex's
# register_*_function, and read when a model is cast, so a registration applies to the models
# initialized after it.
_registered_norm_types: OrderedDict[int, type] = OrderedDict()


def register_norm_type(cls: type[torch.nn.Module]) -> RemovableHandle:
    """Makes O2 (and O3 with keep_batchnorm_fp32=True) keep modules of type `cls`, and its
    subclasses, in fp32 like torch's normalization layers, in models initialized after this
    call: their parameters, buffers and submodules stay fp32, their floating inputs are cast to
    fp32 and their outputs to the model's dtype. Returns a handle whose remove() undoes it."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(
            f"amp.register_norm_type: expected a torch.nn.Module subclass, got {cls!r}. Pass the "
            "class itself, e.g. amp.register_norm_type(MyRMSNorm), not an instance."
        )
    if cls is torch.nn.Module:
        raise ValueError(
            "amp.register_norm_type: torch.nn.Module would keep every module in fp32; register "
            "the normalization class itself. For an fp32 model use opt_level='O0'."
        )
    handle = RemovableHandle(_registered_norm_types)
    _registered_norm_types[handle.id] = cls
    return handle


def norm_types() -> tuple[type, ...]:
    """Every module type that a cast model keeps in fp32: torch's and the registered ones."""
    return NORM_TYPES + tuple(_registered_norm_types.values())


class _StateDictInOriginalDtypes:
    """A state_dict post-hook of a module that cast_model cast: the entries it cast come out in
    the dtype they had before, as apex's O2 hook gave fp16 entries back as fp32. Each module
    converts only its own entries, so a state_dict costs one pass however deep the model."""

    def __init__(self, original_dtypes: dict[str, torch.dtype]) -> None:
        self.original_dtypes = original_dtypes  # name of a param or buffer -> dtype before

    def __call__(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: dict[str, Any]) -> None:
        for name, dtype in self.original_dtypes.items():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or value.dtype == dtype:
                continue
            live = module._parameters.get(name, module._buffers.get(name))
            if value is live:
                continue  # state_dict(keep_vars=True) asked for the live tensors themselves
            state_dict[key] = value.detach().to(dtype)


def _refuse_lazy(module: torch.nn.Module, name: str) -> None:
    lazy = [n for n, t in list(module.named_parameters(recurse=False))
            + list(module.named_buffers(recurse=False)) if isinstance(t, UninitializedTensorMixin)]
    if lazy:
        raise ValueError(
            f"amp.initialize: {type(module).__name__} {name or '(the model)'} has uninitialized "
            f"lazy tensors {lazy}, which cannot be cast to low precision. Run one forward pass "
            "on a sample batch before amp.initialize, so that they exist."
        )


def _cast_own_tensors(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Casts the module's own floating params and buffers to `dtype`; returns {name: dtype
    before} for the ones it changed."""
    original: dict[str, torch.dtype] = {}
    for name, param in module.named_parameters(recurse=False):
        if param.is_floating_point() and param.dtype != dtype:
            original[name] = param.dtype
            param.data = param.data.to(dtype)
    # State a module keeps in fp32 on purpose (ampfuse.fp8.Linear's scales and amaxes).
    keep = getattr(module, "fp32_buffers", ())
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_floating_point() and buffer.dtype != dtype and name not in keep:
            original[name] = buffer.dtype
            setattr(module, name, buffer.to(dtype))
    return original


def cast_model(model: torch.nn.Module, dtype: torch.dtype,
               keep_norm_fp32: bool) -> list[KeptNormForward | RemovableHandle]:
    """Casts floating parameters and buffers to `dtype` in place (the Parameter objects stay
    the same, so optimizers keep pointing at them). With keep_norm_fp32, modules of
    norm_types() stay fp32 with their submodules and run as kept_norms describes (fp32 in and
    `dtype` out, or `dtype` in for torch's batch and instance norms). Every cast module gets a
    state_dict hook that gives its cast entries back in their original dtype. Returns the
    handles of what it installed."""
    kept = norm_types() if keep_norm_fp32 else ()
    handles: list[KeptNormForward | RemovableHandle] = []
    seen: set[int] = set()
    pending = [("", model)]
    while pending:
        name, module = pending.pop()
        if id(module) in seen:  # a module reachable twice is cast once
            continue
        seen.add(id(module))
        if kept and isinstance(module, kept):
            handles += kept_norms.keep_in_fp32(module, dtype)
            continue  # with everything inside it
        _refuse_lazy(module, name)
        original = _cast_own_tensors(module, dtype)
        if original:
            handles.append(
                module.register_state_dict_post_hook(_StateDictInOriginalDtypes(original))
            )
        pending.extend((f"{name}.{child_name}" if name else child_name, child)
                       for child_name, child in module.named_children())
    return handles


def cast_model_io(model: torch.nn.Module, input_dtype: torch.dtype | None,
                  output_dtype: torch.dtype | None) -> list[RemovableHandle]:
    """Hooks casting the model's floating inputs to input_dtype and outputs to output_dtype
    (either may be None)."""
    handles: list[RemovableHandle] = []
    if input_dtype is not None:
        handles.append(model.register_forward_pre_hook(InputsTo(input_dtype),
                                                       with_kwargs=True))
    if output_dtype is not None:
        handles.append(model.register_forward_hook(OutputsTo(output_dtype)))
    return handles
