"""The norm layers that O2 (and O3 with keep_batchnorm_fp32=True) keeps in fp32 inside a
low-precision model: what runs around their forward.

A kept module's parameters and buffers stay fp32. Its floating inputs arrive in the model's
dtype and its outputs must leave in it, so that the next fp16/bf16 layer can take them:
- torch's batch and instance norms take the low dtype as it is. Their kernels (cuDNN on CUDA,
  torch's on the CPU) accept a fp16/bf16 input with fp32 weights, keep mean, variance and the
  running statistics in fp32, and round only the output, which is what apex's O2 gave them.
  On an H100, with the casts to fp32 and back around them, a ResNet-18 O2 step's CUDA self
  time (torch.profiler, ops and kernels summed) was 27.1 ms against torch autocast's 17.8
  (benchmarks/RESULTS.md). SyncBatchNorm is left
  out (its cross-process statistics were not checked in mixed dtypes), and so is a subclass
  with a forward of its own (a frozen batch norm doing its own arithmetic).
- every other kept norm (LayerNorm, GroupNorm, RMSNorm, LRN, registered types) computes in
  fp32: its inputs are cast to fp32 and its outputs back to the model's dtype. torch's CUDA
  layer_norm does not take a fp16 input with fp32 weights.

The casts run in a forward set on the module instance, not in forward hooks: a module with
hooks makes torch's Module.__call__ take its slow path (about 30 Python calls per call, the
bulk of O2's per-step Python on a LayerNorm-heavy model, issue 14); a module without any
calls self.forward directly. A module whose instance already has a forward of its own (set by
another library) keeps it, and gets the casts as hooks instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ampfuse.amp.tensor_casts import LOW_DTYPES, InputsTo, OutputsTo, cast_floats

_MIXED_DTYPE_NORM_FORWARDS = (
    torch.nn.modules.batchnorm._BatchNorm.forward,
    torch.nn.modules.instancenorm._InstanceNorm.forward,
)


def takes_low_precision_input(module: torch.nn.Module) -> bool:
    """Whether a kept module runs on the model's dtype (torch's batch and instance norms)."""
    return (type(module).forward in _MIXED_DTYPE_NORM_FORWARDS
            and not isinstance(module, torch.nn.SyncBatchNorm))


# The default of KeptNormForward's first argument: the module was called without positional
# arguments (norm(input=x)).
_NO_INPUT = object()


class KeptNormForward:
    """The forward set on a kept module's instance: the class's forward, with the floating
    inputs cast to `compute_dtype` and, when `output_dtype` is given, the outputs to it.

    It holds the module itself, so that copy.deepcopy of a model (EMA helpers) and pickling
    carry it over to the copy, pointing at the copied module."""

    def __init__(self, module: torch.nn.Module, compute_dtype: torch.dtype,
                 output_dtype: torch.dtype | None) -> None:
        self.module = module
        self.compute_dtype = compute_dtype
        self.output_dtype = output_dtype

    def __call__(self, x: Any = _NO_INPUT, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        compute_dtype, output_dtype = self.compute_dtype, self.output_dtype
        if not args and not kwargs and x is not _NO_INPUT:  # norm(x): no tuple or dict rebuilt
            # A low-precision tensor, the usual input, is cast here: cast_floats would cost two
            # more Python calls per norm and step (issue 14 counts them).
            if isinstance(x, torch.Tensor) and x.dtype in LOW_DTYPES:
                if x.dtype != compute_dtype:
                    x = x.to(compute_dtype)
            else:
                x = cast_floats(x, compute_dtype)
            output = type(module).forward(module, x)
        else:
            args = args if x is _NO_INPUT else (x, *args)
            output = type(module).forward(module, *cast_floats(args, compute_dtype),
                                          **cast_floats(kwargs, compute_dtype))
        if output_dtype is None:
            return output
        if isinstance(output, torch.Tensor) and output.dtype == torch.float32:
            return output.to(output_dtype)
        return cast_floats(output, output_dtype)

    def remove(self) -> None:
        """Gives the module its class's forward back (a hook handle's interface)."""
        if self.module.__dict__.get("forward") is self:
            del self.module.__dict__["forward"]


def keep_in_fp32(module: torch.nn.Module,
                 dtype: torch.dtype) -> list[KeptNormForward | RemovableHandle]:
    """Makes `module` (left fp32) run inside a model of `dtype`; returns handles with remove()."""
    low_input = takes_low_precision_input(module)
    compute_dtype = dtype if low_input else torch.float32
    output_dtype = None if low_input else dtype  # a low input already gives a low output
    if "forward" not in module.__dict__:
        module.forward = KeptNormForward(module, compute_dtype, output_dtype)
        return [module.forward]
    handles: list[KeptNormForward | RemovableHandle] = [
        module.register_forward_pre_hook(InputsTo(compute_dtype), with_kwargs=True)]
    if output_dtype is not None:
        handles.append(module.register_forward_hook(OutputsTo(output_dtype)))
    return handles
