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
``ampfuse.grad_unscale``) and keeps torch's private hooks, so subclasses written for torch's
class work: ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` (every unscale and
check goes through it), ``_maybe_opt_step``, ``_check_inf_per_device``,
``_found_inf_per_device``, ``_get_scale_async``, and ``_per_optimizer_states`` with torch's
record per optimizer (``stage``, ``found_inf_per_device``, nothing else).

The state (scale, growth and hysteresis trackers) is an ``ampfuse.loss_scaler.LossScaler``,
created lazily on the device of the first outputs given to ``scale()``, as torch does.

Host syncs: none on the path of an optimizer with ``_step_supports_amp_scaling`` (ampfuse's
fused optimizers, torch's ``fused=True`` ones): gradients are only checked, the optimizer divides
the scale out inside its step and skips it on the device. Other optimizers need the overflow flag
on the host to decide whether to call ``optimizer.step()``: one read per step, as with torch.
``get_scale()`` and ``state_dict()`` read values and are meant for logging and checkpoints.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections import abc, defaultdict

import torch
import torch.distributed as dist

# torch's record of an optimizer's progress through an iteration, made by torch's own factory:
# code in the wild and torch's tests read and compare it, so it has exactly torch's keys.
from torch.amp.grad_scaler import OptState
from torch.amp.grad_scaler import _refresh_per_optimizer_state as _fresh_optimizer_state

from ampfuse import _ops
from ampfuse.grad_unscale import cuda_kernels_usable, unscale_grads_
from ampfuse.loss_scaler import LossScaler

__all__ = ["GradScaler"]

_KERNEL_DEVICE_TYPES = ("cpu", "cuda")


class GradScaler:
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
        device="cuda",
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
        *,
        hysteresis=1,
        min_scale=0.0,
        max_scale=math.inf,
        process_group=None,
        all_reduce_found_inf=False,
    ):
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
        self._loss_scaler = None
        # 0-dim views of the LossScaler's scale and growth tracker, under torch's names.
        self._scale = None
        self._growth_tracker = None
        self._ones = {}  # device -> 1.0, the inv_scale of a check that does not unscale
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        # id(optimizer) of the optimizers whose flags were all-reduced this iteration (kept
        # out of their per-optimizer records, which hold torch's keys only).
        self._reduced = set()

    # ---- validation -----------------------------------------------------------------------

    @staticmethod
    def _check_growth_factor(value):
        if not (math.isfinite(value) and value > 1.0):
            raise ValueError(
                f"ampfuse.GradScaler: growth_factor must be a finite number > 1.0, got {value} "
                "(use max_scale to stop the scale from growing past a value)."
            )

    @staticmethod
    def _check_backoff_factor(value):
        if not 0.0 < value < 1.0:
            raise ValueError(
                f"ampfuse.GradScaler: backoff_factor must be in (0, 1), got {value}."
            )

    @staticmethod
    def _check_growth_interval(value):
        if not (isinstance(value, numbers.Integral) and 1 <= value <= 2**31 - 1):
            raise ValueError(
                f"ampfuse.GradScaler: growth_interval must be an int between 1 and 2**31 - 1, "
                f"got {value!r}."
            )

    def _clamp(self, value):
        return min(max(value, self._min_scale), self._max_scale)

    def _require_state(self, what):
        if self._loss_scaler is None:
            raise RuntimeError(
                f"ampfuse.GradScaler.{what} was called before any scale(): the scaler has no "
                "scale yet. Call scaler.scale(loss).backward() earlier in the iteration."
            )
        return self._loss_scaler

    @staticmethod
    def _check_kernel_device(device, what):
        if device.type not in _KERNEL_DEVICE_TYPES:
            raise RuntimeError(
                f"ampfuse.GradScaler: {what} on {device}; ampfuse's kernels run on CPU and CUDA "
                "tensors only (torch.amp.GradScaler covers other devices)."
            )
        if device.type == "cuda" and not cuda_kernels_usable():
            raise RuntimeError(f"ampfuse.GradScaler: {what} on {device}. {_ops.cuda_status()}")

    # ---- the state ------------------------------------------------------------------------

    def _lazy_init(self, device):
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

    def _scale_on(self, device, cache):
        """The scale as a 0-dim tensor on `device`, copied at most once per call of scale()."""
        if self._scale is None:
            self._lazy_init(device)
        if self._scale.device == device:
            return self._scale
        if device not in cache:
            cache[device] = self._scale.to(device=device, non_blocking=True, copy=True)
        return cache[device]

    # ---- scale ----------------------------------------------------------------------------

    def scale(self, outputs):
        """Multiplies a tensor, or the tensors of nested lists/tuples (or a dict's values), by
        the scale; returns them in the same structure. The first call creates the state on the
        first tensor's device. Disabled: returns `outputs` unchanged."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            # The scale is 0-dim, as torch's: a 0-dim fp16 loss comes back in fp32 and any
            # other tensor keeps its dtype and shape.
            return outputs * self._scale_on(outputs.device, {})
        cache = {}

        def apply(value):
            if isinstance(value, torch.Tensor):
                return value * self._scale_on(value.device, cache)
            if isinstance(value, (str, bytes)):
                raise ValueError(
                    "ampfuse.GradScaler.scale: outputs must be a Tensor or nested "
                    f"lists/tuples of Tensors, got a {type(value).__name__}."
                )
            if isinstance(value, abc.Mapping):
                return type(value)((key, apply(item)) for key, item in value.items())
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

    # ---- unscale and check ----------------------------------------------------------------

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's hook, with torch's signature and result: multiplies the optimizer's grads by
        `inv_scale` in place (1.0 only checks them) and returns {device: flag}, each flag a copy
        of `found_inf` set to 1 where that device's grads hold inf/nan. unscale_() and
        _check_inf_per_device() both go through it, so a subclass that overrides it (to reduce
        the flags over shards, say) works as it does with torch's class. Which op takes which
        grad: ampfuse.grad_unscale."""
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def unscale_(self, optimizer):
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

    def _check_inf_per_device(self, optimizer):
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

    def _found_inf_per_device(self, optimizer):
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf(self, key, state):
        """The overflow flag of the optimizer whose id is `key` as one 0-dim tensor on the
        scale's device, all-reduced over the process group when asked for (once per
        iteration: the reduced flag then replaces the per-device ones). No host read."""
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
        return found_inf

    def _all_reduce_(self, found_inf):
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

    def step(self, optimizer, *args, **kwargs):
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
        state["stage"] = OptState.STEPPED
        return retval

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        """torch's hook: steps an optimizer whose grads were unscaled unless they overflowed,
        which costs one host read of the flag (all devices' flags summed first)."""
        retval = None
        if not self._found_inf(id(optimizer), optimizer_state).item():
            retval = optimizer.step(*args, **kwargs)
        return retval

    def _fused_step(self, optimizer, state, args, kwargs):
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # torch's older contract: the optimizer gets the scaler and does the rest itself.
            warnings.warn(
                "ampfuse.GradScaler: the optimizer's step() takes a `grad_scaler` argument, a "
                "contract torch is retiring; the scaler is passed for now. Read the "
                "`grad_scale` and `found_inf` attributes instead.",
                FutureWarning,
                stacklevel=3,
            )
            return optimizer.step(*args, **kwargs, grad_scaler=self)
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
        optimizer.grad_scale = grad_scale
        optimizer.found_inf = found_inf
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            for name in ("grad_scale", "found_inf"):
                try:
                    delattr(optimizer, name)
                except AttributeError:
                    pass

    # ---- update ---------------------------------------------------------------------------

    def update(self, new_scale=None):
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

    def _set_scale(self, loss_scaler, new_scale):
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

    # ---- getters and setters --------------------------------------------------------------

    def _get_scale_async(self):
        return self._scale

    def get_scale(self):
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return self._init_scale
        return float(self._scale.item())

    def _get_growth_tracker(self):
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def _get_hysteresis_tracker(self):
        if self._loss_scaler is None:
            return self._init_hysteresis_tracker
        return int(self._loss_scaler.hysteresis_tracker.item())

    def get_skipped_steps(self):
        """How many iterations so far skipped their optimizer step(s) because gradients held
        inf/nan (counted at update(), once per iteration), as a Python int. Reads the device
        counter (a host sync, like get_scale()): ask when logging, not every step. 0 when
        disabled."""
        if not self._enabled:
            return 0
        if self._loss_scaler is None:
            return self._init_skipped_steps
        return int(self._loss_scaler.skipped_steps.item())

    def get_growth_factor(self):
        return self._growth_factor

    def set_growth_factor(self, new_factor):
        new_factor = float(new_factor)
        self._check_growth_factor(new_factor)
        self._growth_factor = new_factor
        if self._loss_scaler is not None:
            self._loss_scaler.growth_factor = new_factor

    def get_backoff_factor(self):
        return self._backoff_factor

    def set_backoff_factor(self, new_factor):
        new_factor = float(new_factor)
        self._check_backoff_factor(new_factor)
        self._backoff_factor = new_factor
        if self._loss_scaler is not None:
            self._loss_scaler.backoff_factor = new_factor

    def get_growth_interval(self):
        return self._growth_interval

    def set_growth_interval(self, new_interval):
        self._check_growth_interval(new_interval)
        self._growth_interval = new_interval
        if self._loss_scaler is not None:
            self._loss_scaler.growth_interval = new_interval

    def is_enabled(self):
        return self._enabled

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self):
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

    def load_state_dict(self, state_dict):
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
        elif not (isinstance(skipped_steps, numbers.Integral) and skipped_steps >= 0):
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

    def __getstate__(self):
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

    def __setstate__(self, state):
        self.__dict__.update(state)
        # Pickles made before these attributes existed.
        self.__dict__.setdefault("_reduced", set())
        self.__dict__.setdefault("_init_skipped_steps", 0)
