"""Casting the floating tensors inside a call's nested arguments (shared by O1 and O2)."""

from __future__ import annotations

import copy
import functools

import torch

LOW_DTYPES = (torch.float16, torch.bfloat16)


def cast_floats(value, dtype):
    """Casts every floating tensor inside nested lists/tuples/dicts to `dtype`. Containers keep
    their type: a dict subclass (OrderedDict, defaultdict, Hugging Face's ModelOutput, whose
    fields are read as attributes: outputs.loss) is copied and given the cast values."""
    if isinstance(value, torch.Tensor):
        # The dtype test first: it is an attribute read, is_floating_point() a call.
        return value.to(dtype) if value.dtype != dtype and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [cast_floats(v, dtype) for v in value]
        return type(value)(cast) if not hasattr(value, "_fields") else type(value)(*cast)
    if isinstance(value, dict):
        cast = {k: cast_floats(v, dtype) for k, v in value.items()}
        if type(value) is dict:
            return cast
        if all(cast[k] is v for k, v in value.items()):
            return value
        out = copy.copy(value)
        for k, v in cast.items():
            out[k] = v  # ModelOutput's __setitem__ sets the attribute too
        return out
    return value


class InputsTo:
    """A forward pre-hook casting the floating inputs to `dtype` (a class, so that it pickles)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)


class OutputsTo:
    """A forward hook casting the floating outputs to `dtype`."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast_floats(output, self.dtype)


def widest_float(values):
    """The promoted dtype of the floating tensors inside `values` (nested lists/tuples), or
    None when they share one dtype (nothing to promote)."""
    dtypes = set()

    def collect(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            dtypes.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(values)
    if len(dtypes) < 2:
        return None
    return functools.reduce(torch.promote_types, dtypes)  # fp16 with bf16 gives fp32
