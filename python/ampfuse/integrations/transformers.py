"""A Hugging Face Trainer callback that makes the Trainer see steps a fused optimizer skipped.

    from ampfuse.integrations.transformers import AmpfuseTrainerCallback

    trainer = Trainer(model, args, train_dataset=data, optimizers=(FusedAdamW(...), scheduler),
                      callbacks=[AmpfuseTrainerCallback()])

The Trainer steps its LR scheduler after each optimizer step unless
`accelerator.optimizer_step_was_skipped` is True (for ReduceLROnPlateau it does not step it
there at all). With an ampfuse fused optimizer that flag is False even for a step the optimizer
skipped (see ampfuse.integrations.accelerate), so the schedule runs ahead of the optimizer. The
callback applies `track_skipped_steps` to the prepared optimizer when training begins (the
Trainer prepares it just before) and undoes it when training ends.
"""

from __future__ import annotations

from typing import Any

import torch

from ampfuse.integrations import require

require("transformers", "ampfuse.integrations.transformers")

from transformers import (  # noqa: E402
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ampfuse.integrations.accelerate import (  # noqa: E402
    track_skipped_steps,
    untrack_skipped_steps,
)


class AmpfuseTrainerCallback(TrainerCallback):
    """Reports the steps an ampfuse fused optimizer skips to the HF Trainer, so that its LR
    scheduler does not advance on them. The Trainer's optimizer must be an ampfuse fused
    optimizer (passed in `optimizers=` or made by a `create_optimizer` override); anything else
    is a TypeError naming it."""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, optimizer: torch.optim.Optimizer | None = None,
                       **kwargs: Any) -> None:
        track_skipped_steps(optimizer)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, optimizer: torch.optim.Optimizer | None = None,
                     **kwargs: Any) -> None:
        untrack_skipped_steps(optimizer)


__all__ = ["AmpfuseTrainerCallback"]
