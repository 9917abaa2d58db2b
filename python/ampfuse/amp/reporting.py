"""Overflow summaries that never stall the device.

At most once per REPORT_EVERY scale_loss calls, on rank 0, amp logs how many steps were skipped
for overflow since its last summary. Reading a count from the device would wait for the device
to finish its queued work, so the count is copied to the host without blocking, and read at a
later call once the copy is known to be done (a CUDA event says so; a CPU copy is done at once).
"""

from __future__ import annotations

import torch

REPORT_EVERY = 100


class OverflowReporter:
    def __init__(self, handle, log, every=REPORT_EVERY):
        self._handle = handle
        self._log = log
        self._every = every
        self._calls = 0
        self._reported = 0
        self._pending = None  # (host tensor, CUDA event or None)

    def step(self) -> None:
        """Called at the end of every scale_loss."""
        self._calls += 1
        if self._handle.verbosity <= 0:
            return
        if self._pending is not None and self._ready():
            self._report()
        if self._calls % self._every == 0 and self._pending is None:
            self._snapshot()

    def _ready(self):
        event = self._pending[1]
        return event is None or event.query()

    def _snapshot(self):
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        counts = [c for c in self._handle.skipped_counts() if c is not None]
        if not counts:
            return
        count = torch.stack([c.reshape(()) for c in counts]).amax().reshape(1)
        scales = torch.cat([s.scale.reshape(1).to(count.device) for s in self._handle.scalers])
        values = torch.cat([count, scales])
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = values.clone(), None
        self._pending = (host, event)

    def _report(self):
        host, _ = self._pending
        self._pending = None
        values = host.numpy().tolist()
        skipped = int(values[0])
        if skipped > self._reported:
            scales = ", ".join(f"{s:g}" for s in values[1:])
            self._log.warning(
                "ampfuse.amp: %d step(s) skipped for gradient overflow in the last %d steps "
                "(%d in all); loss scale now %s.",
                skipped - self._reported, self._every, skipped, scales,
            )
            self._reported = skipped
