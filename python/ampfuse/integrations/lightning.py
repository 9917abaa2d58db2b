"""Precision plugins that let Lightning's Trainer and Fabric drive ampfuse's fused optimizers.

    from ampfuse.integrations.lightning import AmpfusePrecision, AmpfuseFabricPrecision

    trainer = L.Trainer(plugins=[AmpfusePrecision("16-mixed", device="cuda")],
                        gradient_clip_val=1.0)
    fabric = L.Fabric(plugins=[AmpfuseFabricPrecision("bf16-mixed", device="cuda")])

What Lightning's own plugins do with a fused optimizer, and what these change:

- Gradient clipping. Lightning's MixedPrecision refuses to clip for any optimizer that has
  `_step_supports_amp_scaling` (the Trainer raises "does not allow for gradient clipping because
  it performs unscaling of gradients internally", even under bf16-mixed where no scaler exists;
  Fabric raises "Gradient clipping is not implemented for optimizers handling the unscaling").
  Here clipping unscales the grads first when a scaler is in use (one GradScaler.unscale_ per
  optimizer and step), clips them, and the fused step then takes the scaler's overflow flag with
  no scale left to divide out. Without clipping the fused step still divides the scale out in
  its own pass, so nothing is spent on a separate unscale.
- The scaler under "16-mixed" is an ampfuse.GradScaler (device-side state, skipped steps counted)
  unless one is passed.
- Skipped steps. Lightning's loops have no notion of a skipped optimizer step: with its own
  MixedPrecision a step the GradScaler skips still counts in `global_step`, and LR schedulers
  still step. These plugins keep that behaviour; the count of skipped steps is the optimizer's
  `get_skipped_steps()` (or the scaler's).

Only the unified `lightning` package is supported (`lightning.pytorch`, `lightning.fabric`); the
standalone `pytorch_lightning` package has its own copies of these classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import torch

from ampfuse.integrations import require

require("lightning.pytorch", "ampfuse.integrations.lightning")

from lightning.fabric.plugins.precision import HalfPrecision as _FabricHalf  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision as _FabricMixed  # noqa: E402
from lightning.fabric.plugins.precision import Precision as _FabricPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import HalfPrecision as _TrainerHalf  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _TrainerMixed  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from ampfuse.scaling.grad_scaler import GradScaler  # noqa: E402

_MIXED = ("16-mixed", "bf16-mixed")
_TRUE = ("bf16-true",)
# Devices with ampfuse kernels; the device is the one torch.autocast and the GradScaler use.
_DEVICES = ("cuda", "cpu")

# The scalers a mixed mode takes: ampfuse's (the default for 16-mixed) or torch's.
_Scaler = GradScaler | torch.amp.GradScaler


def _check_precision(cls_name: str, precision: object) -> None:
    if precision not in _MIXED + _TRUE:
        raise ValueError(
            f"{cls_name}: precision={precision!r} is not one of "
            f"{', '.join(repr(p) for p in _MIXED + _TRUE)}. For '32-true', '64-true' or "
            "'16-true' pass `precision=` to the Trainer/Fabric instead of this plugin."
        )


def _mixed_scaler(cls_name: str, precision: str, device: str,
                  scaler: _Scaler | None) -> _Scaler | None:
    """Checks a mixed mode's options; returns the scaler it uses (ampfuse's for 16-mixed unless
    one is given, none for bf16-mixed)."""
    if device not in _DEVICES:
        raise ValueError(
            f"{cls_name}({precision!r}): device={device!r} is not one of {_DEVICES}; pass the "
            "device type the model trains on (the one torch.autocast and the GradScaler use)."
        )
    if scaler is not None and precision == "bf16-mixed":
        raise ValueError(
            f"{cls_name}('bf16-mixed') takes no scaler (bf16 has fp32's range), got {scaler!r}; "
            "use '16-mixed' for loss scaling."
        )
    if scaler is None and precision == "16-mixed":
        scaler = GradScaler(device)
    return scaler


def _check_true(cls_name: str, precision: str, device: str | None,
                scaler: _Scaler | None) -> None:
    if device is not None or scaler is not None:
        raise ValueError(
            f"{cls_name}({precision!r}) takes no device and no scaler: the model itself is cast "
            "to bf16 and nothing is autocast or scaled."
        )


def _handles_unscaling(optimizer: object) -> bool:
    """Lightning's own test for an optimizer that divides the loss scale out inside step()."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


class _UnscaleOnce:
    """Unscales an optimizer's grads at most once per step, for clipping.

    Lightning unscales the grads of ordinary optimizers itself before clipping; for the fused
    ones (which divide the scale out inside step()) it does not, so this does it when clipping
    asks for it. A second clip in the same step finds the grads already unscaled: GradScaler
    would refuse a second unscale_."""

    def __init__(self) -> None:
        # id() of optimizers whose grads are unscaled in the current step
        self._done: set[int] = set()

    def __call__(self, scaler: _Scaler | None, optimizer: torch.optim.Optimizer) -> None:
        if scaler is None or not _handles_unscaling(optimizer) or id(optimizer) in self._done:
            return
        scaler.unscale_(optimizer)
        self._done.add(id(optimizer))

    def step_done(self, optimizer: object) -> None:
        self._done.discard(id(optimizer))


class _PickedByPrecision:
    """`Plugin(precision, ...)` builds the subclass that is Lightning's own kind for the mode
    (MixedPrecision or HalfPrecision), so Lightning's isinstance checks (scaler checkpoints,
    the throughput monitor) see what they expect. The public class lists its two kinds in
    `_kinds` once they are defined."""

    # (the mixed-mode class, the bf16-true class), set on the public class below
    _kinds: ClassVar[tuple[type, type]]

    def __new__(cls, precision: object = None, *args: Any, **kwargs: Any) -> Any:
        kinds = cls.__dict__.get("_kinds")  # only the public class has them
        if kinds is None:
            return super().__new__(cls)
        _check_precision(cls.__name__, precision)
        mixed, true = kinds
        return super().__new__(mixed if precision in _MIXED else true)


class _MixedModes:
    """The mixed-mode plugins of both families: autocast, a GradScaler for 16-mixed."""

    _public_name: str

    def __init__(self, precision: Literal["16-mixed", "bf16-mixed"], device: str = "cuda",
                 scaler: _Scaler | None = None) -> None:
        scaler = _mixed_scaler(self._public_name, precision, device, scaler)
        # (super() is Lightning's MixedPrecision, after the public class in the MRO)
        super().__init__(precision, device, scaler)  # type: ignore[call-arg]
        self._unscale_once = _UnscaleOnce()

    def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().optimizer_step(optimizer, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._unscale_once.step_done(optimizer)


class _TrueModes:
    """The bf16-true plugins of both families: Lightning's HalfPrecision as it is."""

    _public_name: str

    def __init__(self, precision: Literal["bf16-true"], device: None = None,
                 scaler: None = None) -> None:
        _check_true(self._public_name, precision, device, scaler)
        # (super() is Lightning's HalfPrecision, after the public class in the MRO)
        super().__init__(precision)  # type: ignore[call-arg]


class AmpfusePrecision(_PickedByPrecision, _TrainerPrecision):
    """Precision plugin for the Lightning Trainer: `Trainer(plugins=[AmpfusePrecision(...)])`.

    precision:
        "16-mixed": torch.autocast to fp16 on `device`, loss scaling by an ampfuse.GradScaler
            (or the `scaler` given).
        "bf16-mixed": torch.autocast to bf16 on `device`, no scaler.
        "bf16-true": the model is cast to bf16 (Lightning's HalfPrecision); use a fused
            optimizer with master_weights=True to keep fp32 masters. Takes no device or scaler.
    device: "cuda" (default) or "cpu", for the mixed modes.

    The object is a Lightning MixedPrecision (mixed modes) or HalfPrecision ("bf16-true"), so
    everything Lightning does with those applies. What it changes is in the module docstring:
    clipping works with fused optimizers.
    """

    _public_name = "AmpfusePrecision"

    # The constructor, for type checkers: _PickedByPrecision.__new__ makes the object of the
    # mode's kind, whose __init__ (_MixedModes', _TrueModes') takes these.
    if TYPE_CHECKING:
        @overload
        def __init__(self, precision: Literal["16-mixed", "bf16-mixed"], device: str = "cuda",
                     scaler: _Scaler | None = None) -> None: ...

        @overload
        def __init__(self, precision: Literal["bf16-true"], device: None = None,
                     scaler: None = None) -> None: ...

        def __init__(self, precision: str, device: str | None = None,
                     scaler: _Scaler | None = None) -> None: ...


class _AmpfuseTrainerMixed(_MixedModes, AmpfusePrecision, _TrainerMixed):
    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        self._unscale_once(self.scaler, optimizer)
        # Lightning's Precision.clip_gradients, past MixedPrecision's refusal of fused optimizers.
        _TrainerPrecision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class _AmpfuseTrainerTrue(_TrueModes, AmpfusePrecision, _TrainerHalf):
    pass


AmpfusePrecision._kinds = (_AmpfuseTrainerMixed, _AmpfuseTrainerTrue)


class AmpfuseFabricPrecision(_PickedByPrecision, _FabricPrecision):
    """Precision plugin for Lightning Fabric: `Fabric(plugins=[AmpfuseFabricPrecision(...)])`.

    Same arguments and modes as AmpfusePrecision (the Trainer's). The object is a Fabric
    MixedPrecision or HalfPrecision. `fabric.clip_gradients(model, optimizer, max_norm=...)` (or
    `clip_val=...`) works with fused optimizers: under "16-mixed" it unscales their grads first.
    """

    _public_name = "AmpfuseFabricPrecision"

    # The constructor, for type checkers: _PickedByPrecision.__new__ makes the object of the
    # mode's kind, whose __init__ (_MixedModes', _TrueModes') takes these.
    if TYPE_CHECKING:
        @overload
        def __init__(self, precision: Literal["16-mixed", "bf16-mixed"], device: str = "cuda",
                     scaler: _Scaler | None = None) -> None: ...

        @overload
        def __init__(self, precision: Literal["bf16-true"], device: None = None,
                     scaler: None = None) -> None: ...

        def __init__(self, precision: str, device: str | None = None,
                     scaler: _Scaler | None = None) -> None: ...


class _AmpfuseFabricMixed(_MixedModes, AmpfuseFabricPrecision, _FabricMixed):
    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Fabric calls this before clipping; its MixedPrecision refuses fused optimizers here.
        if self.scaler is not None and _handles_unscaling(optimizer):
            self._unscale_once(self.scaler, optimizer)
        else:
            super().unscale_gradients(optimizer)


class _AmpfuseFabricTrue(_TrueModes, AmpfuseFabricPrecision, _FabricHalf):
    pass


AmpfuseFabricPrecision._kinds = (_AmpfuseFabricMixed, _AmpfuseFabricTrue)


__all__ = ["AmpfuseFabricPrecision", "AmpfusePrecision"]

