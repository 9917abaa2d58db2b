"""One iteration of ``ampfuse.GradScaler``: unscale_(), step() and update(), and torch's private
hooks on that path.

torch's GradScaler subclasses and optimizers that take the scaler call these hooks by name
(``_unscale_grads_``, ``_check_inf_per_device``, ``_found_inf_per_device``, ``_maybe_opt_step``,
``_get_scale_async``), so they keep torch's names, signatures and results, and the per-step
path goes through them rather than around them. Kept apart from the class's construction
(``grad_scaler``) and its options and checkpoints (``_grad_scaler_state``) because this is the
part that runs every step: the host-sync rules of the ``grad_scaler`` docstring are kept here.

ScalerIterationMixin works on the attributes GradScaler.__init__ makes (``_enabled``,
``_loss_scaler``, ``_scale``, ``_per_optimizer_states``, ``_reduced``, ``_ones``,
``_all_reduce``, ``_process_group``).
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# torch's record of an optimizer's progress through an iteration, made by torch's own factory:
# code in the wild and torch's tests read and compare it, so it has exactly torch's keys.
from torch.amp.grad_scaler import OptState
from torch.amp.grad_scaler import _refresh_per_optimizer_state as _fresh_optimizer_state

from ampfuse.overflow import OverflowRecords
from ampfuse.scaling.loss_scaler import LossScaler
from ampfuse.scaling.unscale import unscale_grads_


class ScalerIterationMixin:
    """unscale_(), step(), update() and the hooks torch's GradScaler has on that path."""

    # Made by GradScaler.__init__ (declared here for type checkers only).
    _enabled: bool
    _min_scale: float
    _max_scale: float
    _loss_scaler: LossScaler | None
    _scale: torch.Tensor | None
    _per_optimizer_states: defaultdict[int, dict[str, Any]]
    _reduced: set[int]
    _ones: dict[torch.device, torch.Tensor]
    _all_reduce: bool
    _process_group: dist.ProcessGroup | None
    _overflow: OverflowRecords | None

    if TYPE_CHECKING:
        def _clamp(self, value: float) -> float: ...  # ScalerOptionsMixin's

    def _require_state(self, what: str) -> LossScaler:
        if self._loss_scaler is None:
            raise RuntimeError(
                f"ampfuse.GradScaler.{what} was called before any scale(): the scaler has no "
                "scale yet. Call scaler.scale(loss).backward() earlier in the iteration."
            )
        return self._loss_scaler

    # torch's hook for optimizers that take the scaler: the scale as a device tensor, no sync.
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    # ---- unscale and check ----------------------------------------------------------------

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's hook, with torch's signature and result: multiplies the optimizer's grads by
        `inv_scale` in place (1.0 only checks them) and returns {device: flag}, each flag a copy
        of `found_inf` set to 1 where that device's grads hold inf/nan. unscale_() and
        _check_inf_per_device() both go through it, so a subclass that overrides it (to reduce
        the flags over shards, say) works as it does with torch's class. Which op takes which
        grad: ampfuse.scaling.unscale. With attribute_overflow, each call starts the optimizer's
        new overflow record."""
        record = None if self._overflow is None else self._overflow.begin(optimizer)
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16, record)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and records whether any is
        inf/nan. Optional; call it once per optimizer per step, after all gradients are
        accumulated and before step(), e.g. to clip them. Disabled: does nothing."""
        if not self._enabled:
            return
        loss_scaler = self._require_state("unscale_()")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call scaler.update() to finish the "
                "iteration first."
            )
        found_inf = torch.zeros((), dtype=torch.float32, device=loss_scaler.device)
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, loss_scaler.inv_scale(), found_inf, False
        )
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, torch.Tensor]:
        """Checks the optimizer's gradients for inf/nan without unscaling them; returns and
        records the per-device flags. (torch's name, used by optimizers that take the scaler.)"""
        device = self._require_state("_check_inf_per_device()").device
        ones = self._ones.get(device)
        if ones is None:
            ones = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, ones, found_inf, True)
        self._reduced.discard(id(optimizer))
        return state["found_inf_per_device"]

    def _found_inf_per_device(
        self, optimizer: torch.optim.Optimizer
    ) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf(self, key: int, state: dict[str, Any]) -> torch.Tensor:
        """The overflow flag of the optimizer whose id is `key` as one 0-dim tensor on the
        scale's device, all-reduced over the process group when asked for (once per
        iteration: the reduced flag then replaces the per-device ones). No host read."""
        assert self._scale is not None  # step() and update() call this after scale()
        device = self._scale.device
        flags = list(state["found_inf_per_device"].values())
        if len(flags) == 1 and flags[0].device == device:
            found_inf = flags[0]
        elif not flags:
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        else:
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            for flag in flags:  # 0-dim, or one element from a subclass's _unscale_grads_
                found_inf += flag.to(device=device, non_blocking=True).reshape(())
        if self._all_reduce and key not in self._reduced:
            self._all_reduce_(found_inf)
            state["found_inf_per_device"] = {device: found_inf}
            self._reduced.add(key)
            self._note_verdict(key, found_inf)
        return found_inf

    def _note_verdict(self, key: int, found_inf: torch.Tensor) -> None:
        """The all-reduced flag decides the step: a rank whose own grads were clean still
        reports the overflow another rank saw (with no names of its own)."""
        if self._overflow is None:
            return
        for record in self._overflow.records_by_id(key):
            record.set_verdict(found_inf)

    def _all_reduce_(self, found_inf: torch.Tensor) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ampfuse.GradScaler: process_group/all_reduce_found_inf asks for the overflow "
                "flag to be all-reduced, but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first (or construct the scaler without "
                "them for single-process training)."
            )
        # A blocking collective on the flag's device: NCCL queues it on the stream, so the
        # host does not wait for the value.
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._process_group)

    # ---- step -----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Steps the optimizer unless its gradients hold inf/nan; returns what
        optimizer.step(*args, **kwargs) returns (None when skipped).

        An optimizer with `_step_supports_amp_scaling` gets the scale and the overflow flag as
        its `grad_scale` and `found_inf` attributes, takes the step on the still-scaled
        gradients and skips it on the device: no host sync. Any other optimizer gets its
        gradients unscaled (unless unscale_() did it) and is stepped only if the flag, read on
        the host, is clear. Disabled: just calls optimizer.step(*args, **kwargs).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: the closure's "
                "backward() would produce unscaled gradients. Compute the loss, call "
                "scaler.scale(loss).backward(), then scaler.step(optimizer)."
            )
        self._require_state("step()")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(); call scaler.update() "
                "once per iteration, after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            retval = self._fused_step(optimizer, state, args, kwargs)
        else:
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            if not state["found_inf_per_device"]:
                raise RuntimeError(
                    "ampfuse.GradScaler.step(): none of the optimizer's params has a gradient, "
                    "so there is nothing to check or step. Call scaler.scale(loss).backward() "
                    "for a loss that depends on them before scaler.step(optimizer)."
                )
            retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        if self._overflow is not None:
            self._overflow.stepped(optimizer)
        state["stage"] = OptState.STEPPED
        return retval

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        """torch's hook: steps an optimizer whose grads were unscaled unless they overflowed,
        which costs one host read of the flag (all devices' flags summed first)."""
        retval = None
        if not self._found_inf(id(optimizer), optimizer_state).item():
            retval = optimizer.step(*args, **kwargs)
        return retval

    # Outside Dynamo: inside a torch.compile'd training step, setting grad_scale/found_inf on
    # the optimizer raised an AssertionError from Dynamo 2.11 (it cannot track attribute
    # mutation on an optimizer in some resumed frames, e.g. after unscale_() and clipping).
    # The call is a graph break instead, and the optimizer steps as in eager mode.
    @torch._disable_dynamo
    def _fused_step(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # torch's older contract: the optimizer gets the scaler and does the rest itself.
            warnings.warn(
                "ampfuse.GradScaler: the optimizer's step() takes a `grad_scaler` argument, a "
                "contract torch is retiring; the scaler is passed for now. Read the "
                "`grad_scale` and `found_inf` attributes instead.",
                FutureWarning,
                stacklevel=3,
            )
            # An optimizer of that older contract: its step() takes the keyword.
            return optimizer.step(*args, **kwargs, grad_scaler=self)  # type: ignore[call-overload]
        unscaled = state["stage"] is OptState.UNSCALED
        if not unscaled:
            self._check_inf_per_device(optimizer)
        found_inf = self._found_inf(id(optimizer), state)
        user_scale = getattr(optimizer, "grad_scale", None)
        if unscaled:
            grad_scale = user_scale  # the grads already are unscaled
        elif user_scale is None:
            grad_scale = self._scale
        else:
            grad_scale = self._scale * user_scale  # a scale of the caller's own on top
        # torch's contract with optimizers that take the scale: these two attributes.
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            for name in ("grad_scale", "found_inf"):
                try:
                    delattr(optimizer, name)
                except AttributeError:
                    pass

    # ---- update ---------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Ends the iteration: backs the scale off if any optimizer's gradients overflowed
        since the last update(), grows it after growth_interval clean steps (the rule in the
        class docstring), or sets it to `new_scale` (a float, or a one-element tensor on the
        scale's device type, copied) leaving the trackers alone. Either way an iteration
        whose gradients overflowed adds one to get_skipped_steps(). Disabled: does nothing."""
        if not self._enabled:
            return
        loss_scaler = self._require_state("update()")
        flags = []
        for key, state in self._per_optimizer_states.items():
            if self._all_reduce and state["stage"] is not OptState.READY:
                self._found_inf(key, state)  # unscale_() without step(): make it global too
            flags.extend(state["found_inf_per_device"].values())
        if new_scale is None and not flags:
            raise RuntimeError(
                "ampfuse.GradScaler.update(): no gradients were checked since the last "
                "update(); call scaler.step(optimizer) (or scaler.unscale_(optimizer)) for "
                "each optimizer first, or pass new_scale."
            )
        if new_scale is not None:
            self._set_scale(loss_scaler, new_scale)
        if flags:
            total = loss_scaler.found_inf
            total.copy_(flags[0], non_blocking=True)
            for flag in flags[1:]:
                total += flag.to(device=total.device, non_blocking=True)
            if new_scale is None:
                loss_scaler.update()
            else:
                loss_scaler.count_skipped()  # the steps were skipped whatever the new scale
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._reduced = set()

    def _set_scale(self, loss_scaler: LossScaler, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
            loss_scaler.scale.fill_(self._clamp(float(new_scale)))
            return
        if not (
            isinstance(new_scale, torch.Tensor)
            and new_scale.numel() == 1
            and not new_scale.requires_grad
            and new_scale.device.type == loss_scaler.device.type
        ):
            raise ValueError(
                "ampfuse.GradScaler.update: new_scale should be a float or a one-element "
                f"tensor on {loss_scaler.device.type} with requires_grad=False, got "
                f"{new_scale!r}."
            )
        loss_scaler.scale.copy_(new_scale.detach().reshape(1), non_blocking=True)
        loss_scaler.scale.clamp_(self._min_scale, self._max_scale)
