"""Overflow summaries that never stall the device.

At most once per REPORT_EVERY scale_loss calls, on rank 0, amp logs how many steps were skipped
for overflow since its last summary. Reading a count from the device would wait for the device
to finish its queued work, so the count is copied to the host without blocking, and read at a
later call once the copy is known to be done (a CUDA event says so; a CPU copy is done at once).
With overflow attribution on, the per-tensor overflow counts kept on the device
(``attribution.py``) travel in the same copy, and the summary names the tensors that overflowed
most often since the last summary.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ampfuse.overflow import report_name

REPORT_EVERY = 100
MOST_FREQUENT = 3  # tensors a summary names


class OverflowReporter:
    # handle: the AmpHandle that owns this reporter (not imported here: handle imports this
    # module, and amp's modules import in one direction only).
    def __init__(self, handle: Any, log: logging.Logger, every: int = REPORT_EVERY) -> None:
        self._handle = handle
        self._log = log
        self._every = every
        self._calls = 0
        self._reported = 0
        # (host tensor, CUDA event or None, [(binding, params)] counted)
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, list[Any]] | None = None
        # (id(binding), id(param)) -> overflow count at the last summary
        self._counted: dict[tuple[int, int], int] = {}

    def step(self) -> None:
        """Called at the end of every scale_loss."""
        self._calls += 1
        if self._handle.verbosity <= 0:
            return
        if self._pending is not None and self._ready():
            self._report()
        if self._calls % self._every == 0 and self._pending is None:
            self._snapshot()

    def _ready(self) -> bool:
        assert self._pending is not None  # step() asks only then
        event = self._pending[1]
        return event is None or event.query()

    def _snapshot(self) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        counts = [c for c in self._handle.skipped_counts() if c is not None]
        if not counts:
            return
        count = torch.stack([c.reshape(()) for c in counts]).amax().reshape(1)
        scales = torch.cat([s.scale.reshape(1).to(count.device) for s in self._handle.scalers])
        layouts: list[Any] = []  # (binding, params) per counts tensor
        tensor_counts: list[torch.Tensor] = []
        for binding in self._handle.bindings:
            if binding.attribution is not None:
                for params, per_tensor in binding.attribution.counts.values():
                    layouts.append((binding, params))
                    tensor_counts.append(per_tensor.to(count.device, torch.float32))
        values = torch.cat([count, scales, *tensor_counts])
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = values.clone(), None
        self._pending = (host, event, layouts)

    def _report(self) -> None:
        assert self._pending is not None  # step() reports only then
        host, _, layouts = self._pending
        self._pending = None
        values = host.numpy().tolist()
        skipped = int(values[0])
        scale_count = len(self._handle.scalers)
        most_frequent = self._most_frequent(layouts, values[1 + scale_count:])
        if skipped > self._reported:
            scales = ", ".join(f"{s:g}" for s in values[1:1 + scale_count])
            self._log.warning(
                "ampfuse.amp: %d step(s) skipped for gradient overflow in the last %d steps "
                "(%d in all); loss scale now %s.%s",
                skipped - self._reported, self._every, skipped, scales, most_frequent,
            )
            self._reported = skipped

    def _most_frequent(self, layouts: list[Any], counts: list[float]) -> str:
        """" Most often: name (n steps), ..." for the tensors that overflowed most often since
        the last summary, or "" when none did (or attribution is off)."""
        # (id(binding), id(param)) -> (binding, param, count)
        totals: dict[tuple[int, int], tuple[Any, torch.Tensor, int]] = {}
        position = 0
        for binding, params in layouts:
            for param in params:
                key = (id(binding), id(param))
                previous = totals.get(key, (binding, param, 0))[2]
                totals[key] = (binding, param, previous + int(counts[position]))
                position += 1
        new = []
        for key, (binding, param, count) in totals.items():
            if count > self._counted.get(key, 0):
                new.append((count - self._counted.get(key, 0), binding, param))
            self._counted[key] = count
        if not new:
            return ""
        new.sort(key=lambda item: -item[0])  # stable: ties stay in optimizer order
        names = self._handle.param_names.lookup()
        parts = []
        for count, binding, param in new[:MOST_FREQUENT]:
            name = report_name(names, param, *binding.locate(param))
            parts.append(f"{name} ({count} step{'s' * (count != 1)})")
        return " Most often: " + ", ".join(parts) + "."
