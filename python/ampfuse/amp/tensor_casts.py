"""Casting the floating tensors inside a call's nested arguments (shared by O1 and O2)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

LOW_DTYPES = (torch.float16, torch.bfloat16)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Casts every floating tensor inside nested lists/tuples/dicts to `dtype`. Containers keep
    their type: a dict subclass (OrderedDict, defaultdict, Hugging Face's ModelOutput, whose
    fields are read as attributes: outputs.loss) is copied and given the cast values."""
    if isinstance(value, torch.Tensor):
        # The dtype test first: it is an attribute read, is_floating_point() a call.
        return value.to(dtype) if value.dtype != dtype and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast: Any = [cast_floats(v, dtype) for v in value]
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

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)


class OutputsTo:
    """A forward hook casting the floating outputs to `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_floats(output, self.dtype)


def widest_float(values: Any) -> torch.dtype | None:
    """The promoted dtype of the floating tensors inside `values` (nested lists/tuples), or
    None when they share one dtype (nothing to promote)."""
    dtypes: set[torch.dtype] = set()

    def collect(v: Any) -> None:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            dtypes.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(values)
    if len(dtypes) < 2:
        return None
    return functools.reduce(torch.promote_types, dtypes)  # fp16 with bf16 gives fp32
