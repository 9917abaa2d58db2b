"""LossScaler: a loss scale whose whole state lives on the device.

The scale, the growth and hysteresis trackers, the overflow flag and the count of skipped
steps are one-element tensors on the training device. Checking, unscaling and updating never
read them back to the host, so a training step that uses a LossScaler with the fused
optimizers has no host sync. Reading values (``scale_value()``, ``state_dict()``) does sync,
and is meant for logging and checkpoints.

Both ``ampfuse.amp`` (one LossScaler per loss) and ``ampfuse.GradScaler`` are built on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ampfuse import ops


class LossScaler:
    """A static or dynamic loss scale on one device.

    Args:
        init_scale: the first scale (2**16 is the usual dynamic start).
        dynamic: False keeps the scale fixed (static loss scaling); overflowing steps are still
            detected and counted.
        growth_factor, backoff_factor, growth_interval: the dynamic rule. After
            growth_interval clean steps in a row the scale is multiplied by growth_factor. An
            overflow multiplies it by backoff_factor, but see hysteresis.
        hysteresis: the scale backs off only on the hysteresis-th overflow since the last
            backoff or growth (1: on every overflow).
        min_scale, max_scale: bounds the scale never leaves. The scale also never becomes inf.
        device: where the state lives (the device the gradients are on).
    """

    def __init__(self, init_scale: float = 2.0**16, *, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float | None = 0.0, max_scale: float | None = float("inf"),
                 device: str | torch.device = "cpu") -> None:
        init_scale = float(init_scale)
        if not (math.isfinite(init_scale) and init_scale > 0.0):
            raise ValueError(
                f"LossScaler: the loss scale must be a finite number > 0, got {init_scale}. "
                "Use loss_scale='dynamic' or a static value such as 128.0."
            )
        min_scale = 0.0 if min_scale is None else float(min_scale)
        max_scale = float("inf") if max_scale is None else float(max_scale)
        if not 0.0 <= min_scale <= max_scale:
            raise ValueError(
                f"LossScaler: need 0 <= min_scale <= max_scale, got min_scale={min_scale} and "
                f"max_scale={max_scale}."
            )
        self.dynamic = bool(dynamic)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = min_scale
        self.max_scale = max_scale
        device = torch.device(device)
        self.scale = torch.full((1,), min(max(init_scale, min_scale), max_scale),
                                dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full((1,), self.hysteresis, dtype=torch.int32,
                                             device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.skipped_steps = torch.zeros(1, dtype=torch.float32, device=device)
        # Validates the rule's parameters once, with the op's own messages.
        if self.dynamic:
            ops.update_scale_(self.scale.clone(), self.growth_tracker.clone(),
                               self.hysteresis_tracker.clone(), torch.zeros_like(self.found_inf),
                               self.growth_factor, self.backoff_factor, self.growth_interval,
                               self.hysteresis, self.min_scale, self.max_scale)

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def to(self, device: str | torch.device) -> LossScaler:
        """Moves the state to `device` (in place; returns self)."""
        for name in ("scale", "growth_tracker", "hysteresis_tracker", "found_inf",
                     "skipped_steps"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    # ---- one step -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Clears the overflow flag before the gradients of a new step are checked."""
        self.found_inf.zero_()

    def inv_scale(self) -> torch.Tensor:
        return self.scale.double().reciprocal().float()

    def check_(self, grads: Iterable[torch.Tensor],
               tensor_flags: torch.Tensor | None = None) -> None:
        """Flags inf/nan in `grads` without changing them (a read-only pass); tensor_flags as
        for ampfuse.multi_tensor_nonfinite_check_."""
        ops.multi_tensor_nonfinite_check_(grads, self.found_inf, tensor_flags)

    def unscale_(self, grads: Iterable[torch.Tensor]) -> None:
        """Divides `grads` by the scale in place (fp32 math) and flags inf/nan."""
        ops.multi_tensor_unscale_(grads, self.found_inf, self.inv_scale())

    def unscale_into_(self, grads: Iterable[torch.Tensor], dst: Iterable[torch.Tensor]) -> None:
        """Writes grads / scale into `dst` (for example fp32 master grads) and flags inf/nan."""
        ops.multi_tensor_scale_(grads, dst, self.inv_scale(), self.found_inf)

    def count_skipped(self) -> None:
        """Adds one to skipped_steps if the overflow flag is set (update() does this too)."""
        self.skipped_steps += self.found_inf.clamp(max=1.0)

    def update(self, counted_already: torch.Tensor | None = None) -> None:
        """Ends a step: counts it if it overflowed and, for a dynamic scale, applies the rule.

        counted_already: an optional device flag; where it is set, this call leaves the scale,
        its trackers and the skipped count as they were (the overflow it saw was counted by an
        earlier call of the same optimizer step). No host read either way."""
        saved = None
        if counted_already is not None:
            saved = [t.clone() for t in self._update_state()]
        self.count_skipped()
        if self.dynamic:
            ops.update_scale_(self.scale, self.growth_tracker, self.hysteresis_tracker,
                               self.found_inf, self.growth_factor, self.backoff_factor,
                               self.growth_interval, self.hysteresis, self.min_scale,
                               self.max_scale)
        if saved is not None:
            assert counted_already is not None  # saved is made only with it
            keep = counted_already.reshape(1) != 0
            for current, before in zip(self._update_state(), saved):
                current.copy_(torch.where(keep.to(current.device), before, current))

    def _update_state(self) -> tuple[torch.Tensor, ...]:
        return (self.scale, self.growth_tracker, self.hysteresis_tracker, self.skipped_steps)

    # ---- reading and checkpoints (these read values back to the host) ---------------------

    def scale_value(self) -> float:
        return float(self.scale.item())

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale_value(),
            "growth_tracker": int(self.growth_tracker.item()),
            "hysteresis_tracker": int(self.hysteresis_tracker.item()),
            "skipped_steps": int(self.skipped_steps.item()),
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise KeyError(f"LossScaler.load_state_dict: the state lacks {sorted(missing)}.")
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.hysteresis_tracker.fill_(int(state.get("hysteresis_tracker", self.hysteresis)))
        self.skipped_steps.fill_(int(state.get("skipped_steps", 0)))
