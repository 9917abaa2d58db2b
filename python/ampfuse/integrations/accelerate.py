"""Makes Hugging Face Accelerate see a step that a fused optimizer skipped.

    from ampfuse.integrations.accelerate import track_skipped_steps

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    track_skipped_steps(optimizer)

Accelerate decides whether a step was skipped (`AcceleratedOptimizer.step_was_skipped`, and from
it `Accelerator.optimizer_step_was_skipped` and the prepared LR scheduler, which does not advance
after a skipped step) by whether its GradScaler called `optimizer.step()`, and without a scaler
(bf16, or fp32) it never reports a skipped step. ampfuse's fused optimizers are always called
and skip inside, on the device (an inf/nan gradient under `skip_nonfinite`, or the GradScaler's
overflow flag), so Accelerate says False and the scheduler advances. After
`track_skipped_steps`, `step_was_skipped` is also True when the fused optimizer's own
`last_step_skipped` says so.

Why the object's class is switched: the prepared optimizer is referenced by the Accelerator (its
list of optimizers, read by `optimizer_step_was_skipped`) and by every prepared scheduler, and
Accelerate has no hook to choose the class it wraps optimizers in. So the prepared object keeps
its identity and its class becomes `SkipAwareAcceleratedOptimizer`, a subclass of Accelerate's
that only overrides `step_was_skipped`. Accelerate's classes are not changed, and
`untrack_skipped_steps` switches the object back.

Reading `step_was_skipped` reads a device flag: on CUDA it waits for the step to finish, as
Accelerate's own GradScaler path does before it can tell.
"""

from __future__ import annotations

from ampfuse.integrations import require

require("accelerate", "ampfuse.integrations.accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

from ampfuse.optimizers import FusedOptimizer  # noqa: E402


def fused_step_was_skipped(optimizer: object) -> bool:
    """Whether `optimizer`'s last step() was skipped inside it: ampfuse's fused optimizers keep a
    0-dim bool tensor `last_step_skipped` on the params' device (None before their first step).
    An optimizer without one never skips inside."""
    flag = getattr(optimizer, "last_step_skipped", None)
    return flag is not None and bool(flag)


class SkipAwareAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose `step_was_skipped` also reports a step the wrapped
    fused optimizer skipped on the device. Made by track_skipped_steps(); adds no state."""

    @property
    def step_was_skipped(self) -> bool:
        # Accelerate's verdict (its GradScaler did not call step()) or the optimizer's own.
        return super().step_was_skipped or fused_step_was_skipped(self.optimizer)


def track_skipped_steps(optimizer: AcceleratedOptimizer) -> AcceleratedOptimizer:
    """Makes a prepared optimizer (what `accelerator.prepare` returned for an ampfuse fused
    optimizer) report the steps the fused optimizer skips; returns it. Call it once after
    prepare; calling it again is harmless."""
    if isinstance(optimizer, SkipAwareAcceleratedOptimizer):
        return optimizer
    if type(optimizer) is not AcceleratedOptimizer:
        raise TypeError(
            f"track_skipped_steps() takes the optimizer returned by accelerator.prepare() (an "
            f"accelerate.optimizer.AcceleratedOptimizer), got {type(optimizer).__qualname__}; "
            "prepare the optimizer first and pass what prepare() returned."
        )
    if not isinstance(optimizer.optimizer, FusedOptimizer):
        raise TypeError(
            f"track_skipped_steps(): the prepared optimizer wraps a "
            f"{type(optimizer.optimizer).__qualname__}, not an ampfuse fused optimizer; only "
            "those skip steps inside step(), and Accelerate already reports the steps its "
            "GradScaler skips for other optimizers."
        )
    optimizer.__class__ = SkipAwareAcceleratedOptimizer
    return optimizer


def untrack_skipped_steps(optimizer: AcceleratedOptimizer) -> AcceleratedOptimizer:
    """Undoes track_skipped_steps(optimizer): the object is a plain AcceleratedOptimizer again."""
    if isinstance(optimizer, SkipAwareAcceleratedOptimizer):
        optimizer.__class__ = AcceleratedOptimizer
    return optimizer


__all__ = [
    "SkipAwareAcceleratedOptimizer",
    "fused_step_was_skipped",
    "track_skipped_steps",
    "untrack_skipped_steps",
]
