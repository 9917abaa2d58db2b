"""GradScaler: torch.amp.GradScaler's interface on ampfuse's fused ops.

``ampfuse.GradScaler`` is a drop-in for ``torch.amp.GradScaler``: the same constructor, methods,
call order, error cases and ``state_dict`` keys, so a training loop changes one import. What it
adds:

- unscaling and the inf/nan check use ``ampfuse.multi_tensor_unscale_``, one call per device
  for all of an optimizer's gradients whatever their dtypes (bf16 included, on CPU and CUDA);
- the scale follows ampfuse's rule (``update_scale_``): with the defaults it is torch's rule bit
  for bit, and ``hysteresis``, ``min_scale`` and ``max_scale`` extend it;
- ``process_group`` / ``all_reduce_found_inf`` make the skip decision global: the overflow flag
  is all-reduced (MAX) before a step is taken or skipped, for sharded or not-yet-synchronized
  gradients (FSDP, DDP under ``no_sync``), so every rank skips the same steps and keeps the same
  scale;
- ``get_skipped_steps()``: how many iterations skipped their step, counted on the device.

It takes every gradient torch's does (float64, strided views, sparse: see
``ampfuse.scaling.unscale``) and keeps torch's private hooks, so subclasses written for torch's
class work: ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` (every unscale and
check goes through it), ``_maybe_opt_step``, ``_check_inf_per_device``,
``_found_inf_per_device``, ``_get_scale_async``, and ``_per_optimizer_states`` with torch's
record per optimizer (``stage``, ``found_inf_per_device``, nothing else).

The state (scale, growth and hysteresis trackers) is an ``ampfuse.scaling.loss_scaler.LossScaler``,
created lazily on the device of the first outputs given to ``scale()``, as torch does.

Host syncs: none on the path of an optimizer with ``_step_supports_amp_scaling`` (ampfuse's
fused optimizers, torch's ``fused=True`` ones): gradients are only checked, the optimizer divides
the scale out inside its step and skips it on the device. Other optimizers need the overflow flag
on the host to decide whether to call ``optimizer.step()``: one read per step, as with torch.
``get_scale()`` and ``state_dict()`` read values and are meant for logging and checkpoints.

Where the class lives: this module holds its construction, the device state and scale();
``_grad_scaler_iteration`` the per-step path (unscale_, step, update and torch's hooks on it);
``_grad_scaler_state`` the options' getters and setters, state_dict and pickling. GradScaler
inherits both, so every method is on the class under torch's name, as subclasses expect.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

# torch's record of an optimizer's progress through an iteration, made by torch's own factory:
# code in the wild and torch's tests read and compare it, so it has exactly torch's keys.
from torch.amp.grad_scaler import _refresh_per_optimizer_state as _fresh_optimizer_state

from ampfuse import ops
from ampfuse.scaling._grad_scaler_iteration import ScalerIterationMixin
from ampfuse.scaling._grad_scaler_state import ScalerOptionsMixin
from ampfuse.scaling.unscale import cuda_kernels_usable
from ampfuse.scaling.loss_scaler import LossScaler
from ampfuse.overflow import OverflowRecords, OverflowReport

__all__ = ["GradScaler"]

_KERNEL_DEVICE_TYPES = ("cpu", "cuda")

# What scale() hands back in the structure it was given: lists, tuples (named ones too) and
# mappings of tensors, nested.
_Nested = TypeVar("_Nested", bound="list[Any] | tuple[Any, ...] | Mapping[Any, Any]")


class GradScaler(ScalerIterationMixin, ScalerOptionsMixin):
    """Dynamic loss scaling for mixed-precision training, a drop-in for torch.amp.GradScaler.

    Use it exactly as torch's::

        scaler = ampfuse.GradScaler("cuda")
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                  # optional, e.g. to clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                      # skipped if the grads hold inf/nan
            scaler.update()

    Args (torch's, same meaning and order):
        device: the device type the scaler is meant for ("cuda" or "cpu"). As in torch, an
            enabled scaler for "cuda" on a machine without CUDA warns and disables itself. The
            state itself is made on the device of the first outputs passed to scale().
        init_scale: the first scale.
        growth_factor: after growth_interval clean steps in a row the scale is multiplied by it
            (> 1).
        backoff_factor: an overflow multiplies the scale by it (0 < backoff_factor < 1).
        growth_interval: clean steps in a row before the scale grows.
        enabled: False makes every method a pass-through: scale() returns its input, step()
            calls optimizer.step(), get_scale() is 1.0 and state_dict() is {}.

    Keyword-only extras:
        hysteresis: the scale backs off only on the hysteresis-th overflow since the last
            backoff or growth (1, the default, is torch's rule: every overflow).
        min_scale, max_scale: the scale never leaves [min_scale, max_scale]; it also never
            becomes inf. A value given to update(new_scale) or loaded is clamped into them.
        process_group: all-reduce the overflow flag over this group (MAX) before each step
            decision, so that a step is skipped on every rank if any rank overflowed.
        all_reduce_found_inf: the same over the default group (process_group=None).
        attribute_overflow: record, in the unscale/check kernels' own pass, which gradients
            held inf or nan, for last_overflow(). Nothing is read back on a clean step.

    Overflow attribution (attribute_overflow=True):
        last_overflow(optimizer=None) returns None when the optimizer's last checked step was
        clean, else an ampfuse.overflow.OverflowReport: .step (the 0-based index of the step
        the overflow skipped, counting every scaler.step(optimizer) since the scaler was
        made), .param_names and .kinds ("inf", "nan" or "inf and nan" per name). Reading it
        syncs. Params are named "group{i}.param{j}" (their place in the optimizer) unless
        name_parameters(model) (or a named_parameters() iterable) gave their names.

    Skipped steps:
        get_skipped_steps() returns how many iterations (update() calls) had an overflow, so
        that some optimizer's step was skipped; an iteration counts once however many
        optimizers skipped. The count lives on the device next to the scale and is read only
        when asked for (a host sync, like get_scale()). state_dict() saves it as
        "skipped_steps", pickling keeps it, and load_state_dict() restores it; a torch state
        dict, which has no count, leaves it as it is.

    Differences from torch's GradScaler, all deliberate:
        - Misuse raises RuntimeError/ValueError with a message that says what to do, where
          torch raises AssertionError (scale() not called, invalid factors, update() without a
          step). The messages torch users grep for are kept: "unscale_() has already been
          called on this optimizer since the last update()", "step() has already been called
          since the last update()", "Attempting to unscale FP16 gradients".
        - fp16 gradients: unscale_() (and so step() for an optimizer that is not fused) refuses
          them, as torch does, because dividing a scaled fp16 gradient in place pushes its small
          components back into fp16's subnormal range or to zero: precision lost silently, which
          is what the scale was there to prevent. bf16 gradients (fp32's exponent range) and
          fp32 ones are unscaled. With an optimizer that takes the scale itself (ampfuse's fused
          optimizers, optionally with fp32 master weights) fp16 gradients are never unscaled in
          place: step() only checks them and the optimizer divides in fp32.
        - A closure passed to step(), as a keyword (torch's check) or as the first positional
          argument, raises: the closure's backward would not be scaled.
        - update(new_scale) also accepts an int; the value is clamped to [min_scale, max_scale].
        - The optimizer's grad_scale/found_inf attributes are removed after its step() even
          when the step raises, so a failed step cannot leave a stale scale behind.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = 0.0,
        max_scale: float | None = math.inf,
        process_group: dist.ProcessGroup | None = None,
        all_reduce_found_inf: bool = False,
        attribute_overflow: bool = False,
    ) -> None:
        if not isinstance(attribute_overflow, bool):
            raise ValueError(
                f"ampfuse.GradScaler: attribute_overflow must be True or False, got "
                f"{attribute_overflow!r}."
            )
        if not isinstance(device, (str, torch.device)):
            # torch.cuda.amp.GradScaler (and torch.cpu.amp's) took init_scale first.
            raise TypeError(
                f"ampfuse.GradScaler: device={device!r} is not a device. Like "
                "torch.amp.GradScaler, it takes the device first: GradScaler('cuda', "
                f"init_scale={device!r}); torch.cuda.amp.GradScaler's first argument was "
                "init_scale."
            )
        self._device = torch.device(device).type
        self._enabled = bool(enabled)
        if self._enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ampfuse.GradScaler: enabled for device 'cuda', but CUDA is not available on "
                "this machine; the scaler is disabled (scale() and step() pass through). Use "
                "GradScaler('cpu') for CPU training.",
                stacklevel=2,
            )
            self._enabled = False

        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = 0.0 if min_scale is None else float(min_scale)
        self._max_scale = math.inf if max_scale is None else float(max_scale)
        self._process_group = process_group
        self._all_reduce = process_group is not None or bool(all_reduce_found_inf)
        if self._enabled:
            self._check_growth_factor(self._growth_factor)
            self._check_backoff_factor(self._backoff_factor)
            self._check_growth_interval(growth_interval)
            if not (isinstance(hysteresis, numbers.Integral) and hysteresis >= 1):
                raise ValueError(
                    f"ampfuse.GradScaler: hysteresis must be an int >= 1 (1 backs off on every "
                    f"overflow, as torch does), got {hysteresis!r}."
                )
            if not 0.0 <= self._min_scale <= self._max_scale:
                raise ValueError(
                    f"ampfuse.GradScaler: need 0 <= min_scale <= max_scale, got "
                    f"min_scale={self._min_scale} and max_scale={self._max_scale}."
                )
            init_scale = float(init_scale)
            if not (math.isfinite(init_scale) and init_scale > 0.0):
                raise ValueError(
                    f"ampfuse.GradScaler: init_scale must be a finite number > 0, got "
                    f"{init_scale}."
                )
            init_scale = self._clamp(init_scale)
        # Values the state starts from when scale() first creates it (state_dict() and
        # load_state_dict() work before that, as in torch).
        self._init_scale = init_scale
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = self._hysteresis
        self._init_skipped_steps = 0
        self._loss_scaler: LossScaler | None = None
        # 0-dim views of the LossScaler's scale and growth tracker, under torch's names.
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        # device -> 1.0, the inv_scale of a check that does not unscale
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(
            _fresh_optimizer_state)
        # id(optimizer) of the optimizers whose flags were all-reduced this iteration (kept
        # out of their per-optimizer records, which hold torch's keys only).
        self._reduced: set[int] = set()
        # Which grads overflowed at each optimizer's last check (attribute_overflow=True).
        self._overflow: OverflowRecords | None = (
            OverflowRecords() if attribute_overflow else None)

    # ---- the state ------------------------------------------------------------------------

    @staticmethod
    def _check_kernel_device(device: torch.device, what: str) -> None:
        if device.type not in _KERNEL_DEVICE_TYPES:
            raise RuntimeError(
                f"ampfuse.GradScaler: {what} on {device}; ampfuse's kernels run on CPU and CUDA "
                "tensors only (torch.amp.GradScaler covers other devices)."
            )
        if device.type == "cuda" and not cuda_kernels_usable():
            raise RuntimeError(f"ampfuse.GradScaler: {what} on {device}. {ops.cuda_status()}")

    def _lazy_init(self, device: torch.device) -> None:
        self._check_kernel_device(device, "the outputs passed to scale() are")
        scaler = LossScaler(
            self._init_scale,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            device=device,
        )
        scaler.growth_tracker.fill_(self._init_growth_tracker)
        scaler.hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        scaler.skipped_steps.fill_(self._init_skipped_steps)
        self._loss_scaler = scaler
        self._scale = scaler.scale.view(())
        self._growth_tracker = scaler.growth_tracker.view(())

    def _scale_on(self, device: torch.device,
                  cache: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        """The scale as a 0-dim tensor on `device`, copied at most once per call of scale()."""
        if self._scale is None:
            self._lazy_init(device)
        assert self._scale is not None  # made by _lazy_init
        if self._scale.device == device:
            return self._scale
        if device not in cache:
            cache[device] = self._scale.to(device=device, non_blocking=True, copy=True)
        return cache[device]

    # ---- overflow attribution -------------------------------------------------------------

    def _overflow_on(self, what: str) -> OverflowRecords:
        if self._overflow is None:
            raise RuntimeError(
                f"ampfuse.GradScaler.{what}: overflow attribution is off; construct the scaler "
                "with GradScaler(..., attribute_overflow=True)."
            )
        return self._overflow

    def name_parameters(
        self, source: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]]
    ) -> None:
        """Names params in last_overflow() reports: `source` is a model (its
        named_parameters(), looked up when a report is made) or an iterable of (name, param)
        pairs. May be called for several models."""
        self._overflow_on("name_parameters()").names.add(source, "GradScaler.name_parameters")

    def last_overflow(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> OverflowReport | None:
        """None if the last step checked for `optimizer` was clean (or none was checked), else
        an OverflowReport naming the grads that held inf/nan. optimizer=None: the one
        optimizer this scaler checks (an error if it checked several). Reads device flags,
        which syncs; call it on demand, e.g. when get_skipped_steps() grew."""
        records = self._overflow_on("last_overflow()")
        return records.last_overflow(optimizer, "GradScaler.last_overflow")

    # ---- scale ----------------------------------------------------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: _Nested) -> _Nested: ...

    @overload
    def scale(self, outputs: Iterable[Any]) -> Iterable[Any]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiplies a tensor, or the tensors of nested lists/tuples (or a dict's values), by
        the scale; returns them in the same structure. The first call creates the state on the
        first tensor's device. Disabled: returns `outputs` unchanged."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            # The scale is 0-dim, as torch's: a 0-dim fp16 loss comes back in fp32 and any
            # other tensor keeps its dtype and shape.
            return outputs * self._scale_on(outputs.device, {})
        cache: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * self._scale_on(value.device, cache)
            if isinstance(value, (str, bytes)):
                raise ValueError(
                    "ampfuse.GradScaler.scale: outputs must be a Tensor or nested "
                    f"lists/tuples of Tensors, got a {type(value).__name__}."
                )
            if isinstance(value, abc.Mapping):
                # A dict-like type, built from (key, value) pairs as dict is.
                return type(value)(  # type: ignore[call-arg]
                    (key, apply(item)) for key, item in value.items())
            if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
                return type(value)(*(apply(item) for item in value))
            if isinstance(value, (list, tuple)):
                return type(value)(apply(item) for item in value)
            if isinstance(value, abc.Iterable):
                return map(apply, value)  # lazily, as torch does for other iterables
            raise ValueError(
                "ampfuse.GradScaler.scale: outputs must be a Tensor or nested lists/tuples of "
                f"Tensors, got a {type(value).__name__}."
            )

        return apply(outputs)
