"""Whether a fused step is skipped: the found_inf a loss scaler hands over, the skip_nonfinite
check of the grads, and the record of the verdict (last_step_skipped, get_skipped_steps()).

One verdict per optimizer step: every grad that is checked is checked before any param is
written, and if any of them (on any device, in any group) holds inf/nan, every group on every
device skips, as torch's GradScaler skips a whole optimizer. The verdict is a device tensor that
the fused ops read, so deciding costs no host sync.
"""

from __future__ import annotations

import torch

from ampfuse import _ops

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# skip_nonfinite=None checks the grads of a group that steps fp16/bf16 params when no loss
# scaler drives the step; True checks every step; False (the default) never does.
SKIP_NONFINITE_VALUES = (None, True, False)


def check_skip_nonfinite(optimizer, index, group):
    value = group["skip_nonfinite"]
    if value is None or isinstance(value, bool):
        return
    raise ValueError(
        f"{type(optimizer).__name__}: param_groups[{index}] has skip_nonfinite={value!r}; it "
        "must be None (check the grads for inf/nan when the params are fp16/bf16 and no "
        "GradScaler or amp drives the step), True (check every step) or False (never check)."
    )


def moved(t, device):
    """`t` on `device`. Copies to the CPU are blocking: the CPU kernels read the value at once,
    before a non-blocking copy from a GPU would have landed."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def on_device(value, device, cache, name):
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


def _checks(group, calls, driven):
    """Whether step() checks this group's grads for inf/nan."""
    value = group["skip_nonfinite"]
    if value is None:
        return not driven and any(
            p.dtype in _LOW_PRECISION for call in calls for p in call.params
        )
    return value


def step_verdicts(plans, found_inf):
    """{device: one-element fp32 flag, nonzero to skip} for every device the step launches on,
    or {} when nothing can skip this step. `plans` is [(index, group, calls)] of the step."""
    devices, to_check = [], {}
    driven = found_inf is not None
    for _, group, calls in plans:
        checks = _checks(group, calls, driven)
        for call in calls:
            device = call.step.device
            if device not in devices:
                devices.append(device)
            if checks:
                to_check.setdefault(device, []).extend(call.grads)
    if not devices and isinstance(found_inf, torch.Tensor):
        devices.append(found_inf.device)  # nothing to update: the scaler's verdict still counts
    given = {}
    if not to_check:
        return {d: on_device(found_inf, d, given, "found_inf") for d in devices} if driven else {}
    flags = {}
    for device in devices:
        if driven:
            # A copy: the check must not set the scaler's own flag.
            flags[device] = on_device(found_inf, device, given, "found_inf").reshape(()).clone()
        else:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        grads = to_check.get(device)
        if grads:
            _ops.multi_tensor_nonfinite_check_(grads, flags[device])
    if len(devices) == 1:
        return flags
    home = devices[0]
    total = sum(moved(flags[d], home) for d in devices)
    return {d: moved(total, d) for d in devices}


class SkipRecord:
    """last_step_skipped and the skipped-step count of one optimizer."""

    def __init__(self, skipped_before=0):
        self.last = None  # 0-dim bool device tensor of the last step, None before the first
        self.counter = None  # 0-dim int64 device tensor: skips counted since the base
        self.base = skipped_before  # skips carried over from a checkpoint or a pickle
        # device -> a False flag shared by the steps nothing could skip, which are most steps
        # when the check is off: no allocation for them. Never written.
        self.never = {}

    def prepare(self, verdicts, fallback_device, capturing, owner):
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

    def record(self, verdicts, fallback_device):
        """Keeps the verdict of the step that just ran (after prepare())."""
        if not verdicts:
            self.last = self.never[fallback_device]
            return
        skipped = next(iter(verdicts.values())).reshape(()) != 0
        self.counter += moved(skipped, self.counter.device)
        self.last = skipped

    def count(self):
        """The number of skipped steps; reading a device count syncs."""
        return self.base + (int(self.counter.item()) if self.counter is not None else 0)


def _refuse_in_capture(capturing, owner):
    if capturing:
        raise RuntimeError(
            f"{owner}: step() is being captured in a CUDA graph before any eager step with the "
            "same skip settings made the skip record (last_step_skipped, the skipped-step "
            "count); run one step eagerly with the same grad_scale/found_inf/skip_nonfinite, "
            "then capture."
        )
