"""Overflow attribution under amp: which gradients of an optimizer held inf/nan.

One ``StepAttribution`` per optimizer binding. Every check or unscale that amp makes in a step
passes the kernels a device flags tensor (``ampfuse.overflow``); one flags tensor serves every
call of the step that reads the same params in the same order, so grads checked again at each
micro-batch's ``scale_loss`` (the "fold" kind) are flagged once, OR-ed. When the optimizer steps,
the step's flags are added to per-tensor overflow counts on the device, which the rate-limited
summary (``reporting.py``) copies without blocking. Nothing here reads the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.overflow import CheckRecord, place_in_groups


class StepAttribution:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps = 0  # optimizer steps (taken or skipped) so far
        # CheckRecord of the step in progress (a check since the last step)
        self.current: CheckRecord | None = None
        self.last: CheckRecord | None = None  # CheckRecord of the last finished step
        # layout (param ids) -> (params, flags) of the step in progress
        self._flags: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}
        # layout -> (params, int32 counts of steps where each overflowed)
        self.counts: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}

    def flags_for(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step's device flags for an op call that reads the grads of `params`, in order."""
        if self.current is None:
            self.current = CheckRecord(self.steps)
            self._flags = {}
        key = tuple(map(id, params))
        entry = self._flags.get(key)
        if entry is None:
            flags = torch.zeros(len(params), dtype=torch.int32, device=self.device)
            entry = self._flags[key] = (list(params), flags)
            self.current.add([(None, None, p) for p in params], flags)
        return entry[1]

    def set_verdict(self, flag: torch.Tensor | bool) -> None:
        """The flag that decides whether this step is skipped (a device tensor or a bool)."""
        if self.current is not None:
            self.current.set_verdict(flag)

    def end_step(self) -> None:
        """The optimizer stepped: its step's flags are counted and become the last record."""
        for key, (params, flags) in self._flags.items():
            if key not in self.counts:
                self.counts[key] = (params, torch.zeros_like(flags))
            self.counts[key][1].add_(flags.ne(0))
        if self.current is not None:
            self.last = self.current
        self.current, self._flags = None, {}
        self.steps += 1

    def latest(self) -> CheckRecord | None:
        """The record of the step in progress if it was checked, else of the last step."""
        return self.current if self.current is not None else self.last


def place_in_optimizer(optimizer: torch.optim.Optimizer,
                       masters: Iterable[tuple[torch.Tensor, torch.Tensor]],
                       param: torch.Tensor) -> tuple[int, int]:
    """(group index, param index) of `param` in the optimizer, for names of params no model
    holds: the place of its fp32 master for a model param amp keeps one for (`masters`: the
    (model param, master) pairs of the "masters" kind); (-1, -1) once it left the optimizer."""
    target = {id(p): m for p, m in masters}.get(id(param), param)
    return place_in_groups(optimizer.param_groups, target)
