"""apex's private handles that real scripts and trainers touch, as views of ampfuse's state.

- ``amp._amp_state``: ``loss_scalers[i].loss_scale()``, ``._loss_scale`` (read and set),
  ``._unskipped``, ``.dynamic``, ``opt_properties`` (with ``.opt_level``, ``.options``, and
  each option as an attribute), ``verbosity``. It always shows the latest amp.initialize, and
  holds no state of its own.
- ``optimizer._amp_stash``: set on every optimizer amp.initialize returns (trainers test for it
  to see that amp is set up), with apex's fields that still mean something here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from ampfuse.amp.binding import Binding
    from ampfuse.amp.handle import AmpHandle
    from ampfuse.scaling.loss_scaler import LossScaler


class ApexLossScalerView:
    """apex's LossScaler interface over one ampfuse LossScaler. Reading a value reads it from
    the device (a sync), as apex's did; meant for logging and checkpoints."""

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.scale_value()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale_value()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        value = float(value)
        if not value > 0.0:
            raise ValueError(f"amp: a loss scale must be > 0, got {value}.")
        self._scaler.scale.fill_(value)

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.growth_tracker.item())

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._scaler.growth_tracker.fill_(int(value))

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_scale or None

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.growth_interval

    @property
    def _has_overflow(self) -> bool:
        return bool(self._scaler.found_inf.item())


class ApexProperties:
    """apex's Properties: the options of the opt level as attributes and as `.options`."""

    def __init__(self, props: DataclassInstance, enabled: bool) -> None:
        self._props = props
        self.enabled = enabled

    @property
    def options(self) -> dict[str, Any]:
        out = dataclasses.asdict(self._props)
        out["enabled"] = self.enabled
        return out

    def __getattr__(self, name: str) -> Any:
        props = self.__dict__.get("_props")
        if props is not None and name in props.__dataclass_fields__:
            return getattr(props, name)
        raise AttributeError(f"amp._amp_state.opt_properties has no attribute {name!r}")


class AmpStateView:
    """amp._amp_state: apex's module-level state, read from the latest amp.initialize."""

    hard_override = False
    allow_incoming_model_not_fp32 = False

    def __init__(self, latest_handle: Callable[[], AmpHandle | None]) -> None:
        self._latest_handle = latest_handle

    def _handle(self) -> AmpHandle:
        handle = self._latest_handle()
        if handle is None:
            raise AttributeError(
                "amp._amp_state: amp.initialize has not been called (or its models and "
                "optimizers are gone), so there is no amp state to read."
            )
        return handle

    @property
    def loss_scalers(self) -> list[ApexLossScalerView]:
        return [ApexLossScalerView(s) for s in self._handle().scalers]

    @property
    def opt_properties(self) -> ApexProperties:
        handle = self._handle()
        return ApexProperties(handle.props, handle.enabled)

    @property
    def verbosity(self) -> int:
        return self._handle().verbosity

    @property
    def min_loss_scale(self) -> float | None:
        return self._handle().scalers[0].min_scale or None

    @property
    def max_loss_scale(self) -> float:
        return self._handle().scalers[0].max_scale


class AmpStash:
    """optimizer._amp_stash: apex's per-optimizer record, reduced to the fields that mean
    something with ampfuse (the master lists, and whether grads still carry the scale)."""

    lazy_init_called = True
    already_patched = False

    def __init__(self, binding: Binding) -> None:
        self._binding = binding

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        return [p for p, _ in self._binding.master_pairs()]

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return [m for _, m in self._binding.master_pairs()]

    @property
    def params_have_scaled_gradients(self) -> bool:
        b = self._binding
        return b.kind == "fold" and b.window is not None

    def __repr__(self) -> str:
        return f"AmpStash(kind={self._binding.kind!r})"


def parse_loss_scale(value: object) -> float | str | None:
    """apex's spellings of a loss scale: a number, "dynamic", or a number as a string."""
    if value is None or value == "dynamic":
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(
                f"amp.initialize: loss_scale={value!r} is neither 'dynamic' nor a number."
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        raise ValueError(f"amp.initialize: loss_scale must be 'dynamic' or a number, got "
                         f"{value!r}.")
    return float(value)
