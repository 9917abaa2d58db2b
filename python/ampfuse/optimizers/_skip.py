"""Whether a fused step is skipped: the found_inf a loss scaler hands over, the skip_nonfinite
check of the grads, and the record of the verdict (last_step_skipped, get_skipped_steps()).

One verdict per optimizer step: every grad that is checked is checked before any param is
written, and if any of them (on any device, in any group) holds inf/nan, every group on every
device skips, as torch's GradScaler skips a whole optimizer. The verdict is a device tensor that
the fused ops read, so deciding costs no host sync.

When the optimizer's own check decides a step (no loss scaler), the check also flags which
grads held inf/nan, in the same kernel pass (tensor_flags, written only by threads that saw
one): last_overflow() names them, reading the flags only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from ampfuse import ops
from ampfuse.optimizers._call import OpCall
from ampfuse.optimizers._host import OptimizerHost
from ampfuse.overflow import CheckRecord, OverflowReport, place_in_groups

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# skip_nonfinite=None checks the grads of a group that steps fp16/bf16 params when no loss
# scaler drives the step; True checks every step; False (the default) never does.
SKIP_NONFINITE_VALUES = (None, True, False)


def check_skip_nonfinite(optimizer: object, index: int, group: dict[str, Any]) -> None:
    value = group["skip_nonfinite"]
    if value is None or isinstance(value, bool):
        return
    raise ValueError(
        f"{type(optimizer).__name__}: param_groups[{index}] has skip_nonfinite={value!r}; it "
        "must be None (check the grads for inf/nan when the params are fp16/bf16 and no "
        "GradScaler or amp drives the step), True (check every step) or False (never check)."
    )


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. Copies to the CPU are blocking: the CPU kernels read the value at once,
    before a non-blocking copy from a GPU would have landed."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def on_device(value: torch.Tensor | float | None, device: torch.device,
              cache: dict[torch.device, torch.Tensor], name: str) -> torch.Tensor | None:
    """grad_scale / found_inf as a one-element fp32 tensor on `device` (moved at most once per
    device per step; no copy when it is already there)."""
    if value is None:
        return None
    if device not in cache:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"{name} must be a one-element tensor, got shape {tuple(value.shape)}."
                )
            cache[device] = moved(value.to(torch.float32), device)
        else:
            cache[device] = torch.full((), float(value), dtype=torch.float32, device=device)
    return cache[device]


def _checks(group: dict[str, Any], calls: Sequence[OpCall], driven: bool) -> bool:
    """Whether step() checks this group's grads for inf/nan."""
    value = group["skip_nonfinite"]
    if value is None:
        return not driven and any(
            p.dtype in _LOW_PRECISION for call in calls for p in call.params
        )
    return value


def step_verdicts(plans: Sequence[tuple[int, dict[str, Any], Sequence[OpCall]]],
                  found_inf: torch.Tensor | float | None,
                  own_check: CheckRecord | None = None) -> dict[torch.device, torch.Tensor]:
    """{device: one-element fp32 flag, nonzero to skip} for every device the step launches on,
    or {} when nothing can skip this step. `plans` is [(index, group, calls)] of the step.
    own_check: a CheckRecord that an undriven check (no found_inf) fills with the grads it read
    and their per-tensor flags; left empty otherwise."""
    devices: list[torch.device] = []
    to_check: dict[torch.device, list[torch.Tensor]] = {}
    where: dict[torch.device, list[tuple[None, None, torch.Tensor]]] = {}
    driven = found_inf is not None
    if driven:
        own_check = None  # the scaler's flag decides; its attribution is the scaler's
    for _, group, calls in plans:
        checks = _checks(group, calls, driven)
        for call in calls:
            device = call.step.device
            if device not in devices:
                devices.append(device)
            if checks:
                to_check.setdefault(device, []).extend(call.grads)
                if own_check is not None:
                    # Places in the optimizer are looked up only for a report (see report()).
                    where.setdefault(device, []).extend((None, None, p) for p in call.params)
    if not devices and isinstance(found_inf, torch.Tensor):
        devices.append(found_inf.device)  # nothing to update: the scaler's verdict still counts
    given: dict[torch.device, torch.Tensor] = {}
    # driven: found_inf is not None, so on_device returns a tensor.
    if not to_check:
        return {d: cast(torch.Tensor, on_device(found_inf, d, given, "found_inf"))
                for d in devices} if driven else {}
    flags: dict[torch.device, Any] = {}
    for device in devices:
        if driven:
            # A copy: the check must not set the scaler's own flag.
            flag = cast(torch.Tensor, on_device(found_inf, device, given, "found_inf"))
            flags[device] = flag.reshape(()).clone()
        else:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        grads = to_check.get(device)
        if grads:
            tensor_flags = None
            if own_check is not None:
                tensor_flags = torch.zeros(len(grads), dtype=torch.int32, device=device)
                own_check.add(where[device], tensor_flags)
            ops.multi_tensor_nonfinite_check_(grads, flags[device], tensor_flags)
    if len(devices) > 1:
        home = devices[0]
        total = cast(torch.Tensor, sum(moved(flags[d], home) for d in devices))
        flags = {d: moved(total, d) for d in devices}
    if own_check is not None and own_check.calls:
        own_check.set_verdict(next(iter(flags.values())))
    return flags


class _GroupNames:
    """Names and places of params for an overflow report: the names torch's optimizers keep
    when built from named parameters (optimizer(model.named_parameters()) puts them in each
    group's "param_names"), else the param's place, "group0.param7"."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        self._groups = param_groups

    def lookup(self) -> dict[int, str]:
        return {id(p): name for group in self._groups
                for p, name in zip(group["params"], group.get("param_names", ()))}

    def locate(self, param: torch.Tensor) -> tuple[int, int]:
        """(group index, param index); (-1, -1) once the param left the optimizer, as amp's
        reports say it."""
        return place_in_groups(self._groups, param)


class SkipReportMixin(OptimizerHost):
    """A fused optimizer's public record of skipped steps, kept in its SkipRecord `_skips`."""

    @property
    def last_step_skipped(self) -> torch.Tensor | None:
        """Whether the last step() was skipped, by skip_nonfinite's check or by a found_inf
        from a loss scaler: a 0-dim bool tensor on the params' device (reading its value
        syncs). A step that could be skipped gets a new tensor; one that nothing could skip (no
        check, no found_inf) reports False. None before the first step and after
        load_state_dict()."""
        return self._skips.last

    def last_overflow(self) -> OverflowReport | None:
        """Which grads held inf/nan when skip_nonfinite's own check skipped the last step():
        an OverflowReport (ampfuse.overflow) naming them, by the names torch keeps for
        optimizer(model.named_parameters()), else "group0.param7". None after a clean or
        unchecked step, and after one a loss scaler's found_inf decided (ask the scaler or
        amp). Reads device flags: a host sync."""
        return self._skips.overflow_report(self.param_groups)

    def get_skipped_steps(self) -> int:
        """How many steps were skipped so far, by skip_nonfinite or by a found_inf from a loss
        scaler (torch.amp.GradScaler, ampfuse.GradScaler, amp). Counted on the device; reading
        it syncs. state_dict() saves it as 'skipped_steps' and load_state_dict() restores it."""
        return self._skips.count()


class SkipRecord:
    """last_step_skipped and the skipped-step count of one optimizer."""

    def __init__(self, skipped_before: int = 0) -> None:
        # 0-dim bool device tensor of the last step, None before the first
        self.last: torch.Tensor | None = None
        # 0-dim int64 device tensor: skips counted since the base
        self.counter: torch.Tensor | None = None
        self.base = skipped_before  # skips carried over from a checkpoint or a pickle
        # device -> a False flag shared by the steps nothing could skip, which are most steps
        # when the check is off: no allocation for them. Never written.
        self.never: dict[torch.device, torch.Tensor] = {}
        self.steps = 0  # step() calls since this record was made (an overflow report's step)
        # the last step's CheckRecord when its own check decided it
        self.own_check: CheckRecord | None = None

    def new_check(self, attribute: bool) -> CheckRecord | None:
        """The CheckRecord this step's own check fills (see step_verdicts), or None where no
        flags are kept: under torch.compile, and in CUDA graph capture, whose replays would
        not make a new record. Forgets the last step's."""
        self.own_check = None
        self.steps += 1
        return CheckRecord(self.steps - 1) if attribute else None

    def overflow_report(self, param_groups: list[dict[str, Any]]) -> OverflowReport | None:
        """The OverflowReport of the last step if the optimizer's own check skipped it, else
        None. Reads the flags (a host sync)."""
        if self.own_check is None:
            return None
        names = _GroupNames(param_groups)
        return self.own_check.report(names, names.locate)

    def prepare(self, verdicts: dict[torch.device, torch.Tensor], fallback_device: torch.device,
                capturing: bool, owner: str) -> None:
        """Makes what record() will need for this step's verdicts ({} when nothing can skip
        the step), before any param is updated. `capturing`: the step is being captured in a
        CUDA graph, where a tensor made now holds nothing until the first replay (and a
        counter made now would be zeroed at every replay): refused, naming `owner`."""
        if not verdicts:
            if fallback_device not in self.never:
                _refuse_in_capture(capturing, owner)
                self.never[fallback_device] = torch.zeros((), dtype=torch.bool,
                                                          device=fallback_device)
        elif self.counter is None:
            _refuse_in_capture(capturing, owner)
            self.counter = torch.zeros((), dtype=torch.int64, device=next(iter(verdicts)))

    def record(self, verdicts: dict[torch.device, torch.Tensor], fallback_device: torch.device,
               own_check: CheckRecord | None = None) -> None:
        """Keeps the verdict of the step that just ran (after prepare()), and own_check when
        the step's own check filled it."""
        if own_check is not None and own_check.calls:
            self.own_check = own_check
        if not verdicts:
            self.last = self.never[fallback_device]
            return
        skipped = next(iter(verdicts.values())).reshape(()) != 0
        counter = cast(torch.Tensor, self.counter)  # prepare() made it
        counter += moved(skipped, counter.device)
        self.last = skipped

    def count(self) -> int:
        """The number of skipped steps; reading a device count syncs."""
        return self.base + (int(self.counter.item()) if self.counter is not None else 0)


def _refuse_in_capture(capturing: bool, owner: str) -> None:
    if capturing:
        raise RuntimeError(
            f"{owner}: step() is being captured in a CUDA graph before any eager step with the "
            "same skip settings made the skip record (last_step_skipped, the skipped-step "
            "count); run one step eagerly with the same grad_scale/found_inf/skip_nonfinite, "
            "then capture."
        )
