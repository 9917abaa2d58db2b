"""The four optimization levels, as frozen dataclasses. A keyword given to
amp.initialize overrides its level's default through dataclasses.replace, and the
result is checked for combinations that cannot work."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ampfuse.amp.apex_state import parse_loss_scale


@dataclasses.dataclass(frozen=True)
class Properties:
    opt_level: str
    cast_model_type: torch.dtype | None  # None: the model keeps its dtype
    patch_torch_functions: bool          # O1's per-op casting (done with autocast, no patching)
    keep_batchnorm_fp32: bool | None     # normalization layers stay fp32 in a cast model
    master_weights: bool                 # fp32 masters for low-precision params
    loss_scale: float | str              # a static scale, or "dynamic" (default_loss_scale)
    cast_model_outputs: torch.dtype | None  # outputs cast to this dtype (O2: fp32)


def default_loss_scale(low: torch.dtype) -> float | str:
    """O1 and O2's loss scale when none is given: dynamic for fp16, whose small gradients
    underflow without one; 1.0 for bf16, which has fp32's exponent range (torch and DeepSpeed
    train bf16 unscaled). Either way a step whose gradients hold inf/nan is skipped."""
    return "dynamic" if low == torch.float16 else 1.0


def _level(opt_level: str, low: torch.dtype) -> Properties:
    if opt_level == "O0":
        return Properties("O0", torch.float32, False, None, False, 1.0, None)
    if opt_level == "O1":
        # Outputs in fp32: a loss computed outside the forward (criterion(model(x), y)) then
        # runs in fp32, as under apex's O1, where loss functions were on the fp32 list.
        return Properties("O1", None, True, None, False, default_loss_scale(low), torch.float32)
    if opt_level == "O2":
        return Properties("O2", low, False, True, True, default_loss_scale(low), torch.float32)
    if opt_level == "O3":
        return Properties("O3", low, False, False, False, 1.0, None)
    raise ValueError(
        f"amp.initialize: unknown opt_level {opt_level!r}; use 'O0' (fp32), 'O1' (per-op "
        "casting), 'O2' (low-precision model with fp32 masters) or 'O3' (all low precision). "
        "The letter is a capital O, not a zero."
    )


_OVERRIDABLE = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                "master_weights", "loss_scale", "cast_model_outputs")


def resolve(opt_level: str, low: torch.dtype, overrides: dict[str, Any]) -> Properties:
    """The level's defaults with every non-None override applied, then checked."""
    props = _level(opt_level, low)
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - set(_OVERRIDABLE)
    if unknown:
        raise TypeError(f"amp.initialize: unknown options {sorted(unknown)}.")
    if "keep_batchnorm_fp32" in given and isinstance(given["keep_batchnorm_fp32"], str):
        # apex accepts the strings "True" and "False" here.
        given["keep_batchnorm_fp32"] = {"True": True, "False": False}[given["keep_batchnorm_fp32"]]
    if "loss_scale" in given:
        given["loss_scale"] = parse_loss_scale(given["loss_scale"])
    props = dataclasses.replace(props, **given)
    _check(props)
    return props


def _check(props: Properties) -> None:
    scale = props.loss_scale
    if scale != "dynamic":
        if isinstance(scale, str) or not isinstance(scale, (int, float)):
            raise ValueError(
                f"amp.initialize: loss_scale must be 'dynamic' or a number, got {scale!r}."
            )
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"amp.initialize: a static loss_scale must be a finite number > 0, got {scale}. "
                "Use loss_scale='dynamic' to let ampfuse pick it, or a value such as 128.0."
            )
    low_model = props.cast_model_type in (torch.float16, torch.bfloat16)
    if props.master_weights and not low_model:
        raise ValueError(
            f"amp.initialize: master_weights=True needs a low-precision model "
            f"(cast_model_type float16/bfloat16), but {props.opt_level} keeps "
            f"{props.cast_model_type}. Drop master_weights or use opt_level='O2'."
        )
    if props.patch_torch_functions and low_model:
        raise ValueError(
            "amp.initialize: per-op casting (patch_torch_functions, O1) runs on an fp32 model; "
            "it cannot be combined with cast_model_type float16/bfloat16. Use O1 or O2, not both."
        )
    fp16_model = props.cast_model_type == torch.float16
    if props.opt_level == "O2" and not props.master_weights and fp16_model:
        raise ValueError(
            "amp.initialize: O2 with master_weights=False would update fp16 weights directly "
            "with fp16 gradients, which loses small updates. Keep master_weights=True, or use "
            "opt_level='O3' if pure fp16 training is really what you want."
        )
