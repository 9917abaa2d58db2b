"""amp.initialize's argument checks: what it refuses, before anything is changed, and the
low-precision dtype it picks. Each error names the problem and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ampfuse.amp.optimizer_access import hookable

if TYPE_CHECKING:
    from ampfuse.amp.opt_levels import Properties

# The attribute amp.initialize sets on each model and optimizer it took (its handle).
ATTR = "_ampfuse_amp"


class OptimizerLike(Protocol):
    """What amp takes as an optimizer: a torch.optim.Optimizer, or a wrapper that steps one
    with the same param_groups (apex's LARC), as check_optimizers accepts."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def as_list(value: Any) -> tuple[list[Any], bool]:
    if value is None:
        return [], False
    if isinstance(value, (list, tuple)):
        return list(value), True
    return [value], False


def model_device(models: Iterable[torch.nn.Module]) -> torch.device:
    for model in models:
        for tensor in list(model.parameters()) + list(model.buffers()):
            return tensor.device
    return torch.device("cpu")


def check_models(models: Iterable[object]) -> None:
    for model in models:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"amp.initialize: expected torch.nn.Module models, got {type(model)}.")
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel,
                              torch.nn.DataParallel)):
            raise RuntimeError(
                "amp.initialize: the model is already wrapped in "
                f"{type(model).__name__}. Call amp.initialize on the bare model first and wrap "
                "the model it returns: model, opt = amp.initialize(model, opt); "
                "model = DistributedDataParallel(model)."
            )
        if getattr(model, ATTR, None) is not None:
            raise RuntimeError(
                "amp.initialize: this model was already initialized; call amp.initialize once "
                "per model (with all of its optimizers)."
            )


def check_optimizers(optimizers: Iterable[object]) -> None:
    for optimizer in optimizers:
        if hookable(optimizer) is None:
            raise TypeError(
                f"amp.initialize: expected torch.optim.Optimizer objects, got {type(optimizer)}. "
                "An optimizer wrapper (such as LARC) is accepted when it has `param_groups` and "
                "keeps the torch.optim.Optimizer it steps in an attribute named `optim` or "
                "`optimizer` that shares those param_groups."
            )
        if getattr(optimizer, ATTR, None) is not None:
            raise RuntimeError(
                "amp.initialize: this optimizer was already passed to amp.initialize. Calling it "
                "twice would make a second set of master weights and loss scalers; build a new "
                "optimizer, or keep the first initialization."
            )


def check_param_dtypes(models: Iterable[torch.nn.Module], props: Properties) -> None:
    if props.cast_model_type == torch.float32:
        return  # O0 (or cast_model_type=torch.float32): model.float() makes it fp32 as apex did
    for model in models:
        for name, p in model.named_parameters():
            if p.dtype == torch.float64:
                raise ValueError(
                    f"amp.initialize: {type(model).__name__}.{name} is float64. {props.opt_level} "
                    "trains an fp32 model in mixed precision (a float64 model would silently "
                    "lose its precision); call model.float() before amp.initialize, or use "
                    "opt_level='O0' to train in fp32."
                )


def check_lists(props: Properties, white: object, black: object) -> None:
    if (white or black) and not props.patch_torch_functions:
        raise ValueError(
            f"amp.initialize: custom_white_list/custom_black_list apply to O1's per-op casting, "
            f"but opt_level={props.opt_level!r} casts the model instead and would ignore them. "
            "Use opt_level='O1', or drop the lists."
        )


def low_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"amp.initialize: dtype must be torch.float16 or torch.bfloat16, got {dtype}."
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(
            f"amp.initialize: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
            "use dtype=torch.float16."
        )
    return dtype
