"""``ampfuse.GradScaler``'s options and checkpoints: validating the scaling rule's values, the
getters and setters torch's class has, state_dict()/load_state_dict() in a form torch's class
loads (and that loads torch's), and pickling.

None of it runs on the per-step path (that is ``_grad_scaler_iteration``; construction and
scale() are in ``grad_scaler``); it is where compatibility with torch's checkpoints and with
pickles made by earlier versions lives.

ScalerOptionsMixin works on the attributes GradScaler.__init__ makes (``_enabled``, the
options, the ``_init_*`` values the state starts from, ``_loss_scaler`` and its views).
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.amp.grad_scaler import _refresh_per_optimizer_state as _fresh_optimizer_state

from ampfuse.scaling.loss_scaler import LossScaler


class ScalerOptionsMixin:
    """Validation, getters and setters, state_dict()/load_state_dict() and pickling."""

    # Made by GradScaler.__init__ (declared here for type checkers only).
    _enabled: bool
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _hysteresis: int
    _min_scale: float
    _max_scale: float
    _init_scale: float
    _init_growth_tracker: int
    _init_hysteresis_tracker: int
    _init_skipped_steps: int
    _loss_scaler: LossScaler | None
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _per_optimizer_states: defaultdict[int, dict[str, Any]]

    # ---- validation -----------------------------------------------------------------------

    @staticmethod
    def _check_growth_factor(value: float) -> None:
        if not (math.isfinite(value) and value > 1.0):
            raise ValueError(
                f"ampfuse.GradScaler: growth_factor must be a finite number > 1.0, got {value} "
                "(use max_scale to stop the scale from growing past a value)."
            )

    @staticmethod
    def _check_backoff_factor(value: float) -> None:
        if not 0.0 < value < 1.0:
            raise ValueError(
                f"ampfuse.GradScaler: backoff_factor must be in (0, 1), got {value}."
            )

    @staticmethod
    def _check_growth_interval(value: int) -> None:
        if not (isinstance(value, numbers.Integral) and 1 <= value <= 2**31 - 1):
            raise ValueError(
                f"ampfuse.GradScaler: growth_interval must be an int between 1 and 2**31 - 1, "
                f"got {value!r}."
            )

    def _clamp(self, value: float) -> float:
        return min(max(value, self._min_scale), self._max_scale)

    # ---- getters and setters --------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return self._init_scale
        return float(self._scale.item())

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._loss_scaler is None:
            return self._init_hysteresis_tracker
        return int(self._loss_scaler.hysteresis_tracker.item())

    def get_skipped_steps(self) -> int:
        """How many iterations so far skipped their optimizer step(s) because gradients held
        inf/nan (counted at update(), once per iteration), as a Python int. Reads the device
        counter (a host sync, like get_scale()): ask when logging, not every step. 0 when
        disabled."""
        if not self._enabled:
            return 0
        if self._loss_scaler is None:
            return self._init_skipped_steps
        return int(self._loss_scaler.skipped_steps.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        new_factor = float(new_factor)
        self._check_growth_factor(new_factor)
        self._growth_factor = new_factor
        if self._loss_scaler is not None:
            self._loss_scaler.growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        new_factor = float(new_factor)
        self._check_backoff_factor(new_factor)
        self._backoff_factor = new_factor
        if self._loss_scaler is not None:
            self._loss_scaler.backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._check_growth_interval(new_interval)
        self._growth_interval = new_interval
        if self._loss_scaler is not None:
            self._loss_scaler.growth_interval = new_interval

    def is_enabled(self) -> bool:
        return self._enabled

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries ("scale", "growth_factor", "backoff_factor", "growth_interval",
        "_growth_tracker") plus "hysteresis", "_hysteresis_tracker", "min_scale", "max_scale"
        and "skipped_steps"; {} when disabled. torch.amp.GradScaler loads it (ignoring ours), and a
        torch state dict loads here. Reads values back from the device: call it after
        update()."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "skipped_steps": self.get_skipped_steps(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a state dict of this class or of torch.amp.GradScaler. Our entries that a
        torch state dict lacks keep their current values (the hysteresis count restarts).
        Disabled: does nothing."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        required = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                    "_growth_tracker")
        missing = [key for key in required if key not in state_dict]
        if missing:
            raise KeyError(
                f"ampfuse.GradScaler.load_state_dict: the state dict lacks {missing}; it must "
                "come from GradScaler.state_dict() (ampfuse's or torch's)."
            )
        growth_factor = float(state_dict["growth_factor"])
        backoff_factor = float(state_dict["backoff_factor"])
        growth_interval = int(state_dict["growth_interval"])
        hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        min_scale = float(state_dict.get("min_scale", self._min_scale))
        max_scale = float(state_dict.get("max_scale", self._max_scale))
        skipped_steps = state_dict.get("skipped_steps")
        # Validate everything before changing anything.
        self._check_growth_factor(growth_factor)
        self._check_backoff_factor(backoff_factor)
        self._check_growth_interval(growth_interval)
        if hysteresis < 1 or not 0.0 <= min_scale <= max_scale:
            raise ValueError(
                f"ampfuse.GradScaler.load_state_dict: invalid hysteresis={hysteresis}, "
                f"min_scale={min_scale}, max_scale={max_scale}."
            )
        if skipped_steps is None:  # a torch state dict: the count goes on from its value
            skipped_steps = self.get_skipped_steps()
        # (typeshed's numbers.Integral has no comparisons; int, numpy's ints and the like do)
        elif not (isinstance(skipped_steps, numbers.Integral)
                  and skipped_steps >= 0):  # type: ignore[operator]
            raise ValueError(
                "ampfuse.GradScaler.load_state_dict: skipped_steps must be an int >= 0, got "
                f"{skipped_steps!r}."
            )
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._init_scale = self._clamp(float(state_dict["scale"]))
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", hysteresis))
        self._init_skipped_steps = int(skipped_steps)
        loss_scaler = self._loss_scaler
        if loss_scaler is not None:
            loss_scaler.growth_factor = growth_factor
            loss_scaler.backoff_factor = backoff_factor
            loss_scaler.growth_interval = growth_interval
            loss_scaler.hysteresis = hysteresis
            loss_scaler.min_scale = min_scale
            loss_scaler.max_scale = max_scale
            loss_scaler.scale.fill_(self._init_scale)
            loss_scaler.growth_tracker.fill_(self._init_growth_tracker)
            loss_scaler.hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            loss_scaler.skipped_steps.fill_(self._init_skipped_steps)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if any(s["stage"] is not OptState.READY or s["found_inf_per_device"]
                   for s in self._per_optimizer_states.values()):
                raise RuntimeError(
                    "ampfuse.GradScaler can only be pickled (or deep-copied) at the start of an "
                    "iteration or after scaler.update(), not between step() and update()."
                )
            # The unpickled scaler recreates its device state lazily from these values.
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_init_skipped_steps"] = self.get_skipped_steps()
        state["_loss_scaler"] = None
        state["_scale"] = None
        state["_growth_tracker"] = None
        state["_ones"] = {}
        state["_per_optimizer_states"] = defaultdict(_fresh_optimizer_state)
        state["_reduced"] = set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # Pickles made before these attributes existed.
        self.__dict__.setdefault("_reduced", set())
        self.__dict__.setdefault("_init_skipped_steps", 0)
        self.__dict__.setdefault("_overflow", None)  # attribute_overflow off
