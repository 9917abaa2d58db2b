"""The dynamic loss-scale rule on the device: typed wrapper and fake kernel (C++ in
csrc/ops/update_scale.cpp).
"""

from __future__ import annotations

import torch

from ampfuse.ops._checks import check_scalar
from ampfuse.ops import _library  # noqa: F401  (registers the ops first)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """One step of the dynamic loss-scale rule, on the scale's device."""
    torch.ops.ampfuse.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale,
    )


@torch.library.register_fake("ampfuse::update_scale_")
def _update_scale_fake(scale: torch.Tensor, growth_tracker: torch.Tensor,
                       hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor,
                       growth_factor: float, backoff_factor: float, growth_interval: int,
                       hysteresis: int, min_scale: float, max_scale: float) -> None:
    op = "update_scale_"
    check_scalar(op, "scale", scale, torch.float32, scale.device)
    for name, t, dtype in (("growth_tracker", growth_tracker, torch.int32),
                           ("hysteresis_tracker", hysteresis_tracker, torch.int32),
                           ("found_inf", found_inf, torch.float32)):
        check_scalar(op, name, t, dtype, scale.device, device_owner="scale")
