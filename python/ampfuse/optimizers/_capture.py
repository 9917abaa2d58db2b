"""What a fused step may do while it is captured in a CUDA graph.

A captured step is replayed as recorded: a tensor made during capture holds nothing until the
first replay, and host-side decisions are frozen. So a step under capture needs
capturable=True, and refuses to create optimizer state or re-lay it out; one eager step first
makes everything the graph then reuses. Kept apart from the step launcher (``_base``) because
the step, the state code (``_state``) and sparse grads (``_sparse``) all ask it.
"""

from __future__ import annotations

import torch

from ampfuse.optimizers._host import OptimizerHost
from ampfuse.overflow import param_name


class CaptureRulesMixin(OptimizerHost):
    """Whether a step is being captured, and the refusals that follow from it."""

    def _capturing(self, compiling: bool | None = None) -> bool:
        """Whether this step is being captured in a CUDA graph. `compiling`: what step() already
        asked torch.compiler.is_compiling() (asked here when not given)."""
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        # No capture runs before CUDA is initialized; is_initialized() is a flag read where
        # is_available() asks the driver (or NVML) on every step.
        if compiling or not torch.cuda.is_initialized():
            return False
        return torch.cuda.is_current_stream_capturing()

    def _check_capture(self, capturing: bool) -> None:
        if capturing and not all(g.get("capturable", True) for g in self.param_groups):
            raise RuntimeError(
                f"{type(self).__name__}: step() is being captured in a CUDA graph but "
                "capturable=False; construct the optimizer with capturable=True."
            )

    def _check_not_capturing(self, group_index: int, param_index: int) -> None:
        if self._capturing():
            raise RuntimeError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has no optimizer "
                "state yet and state cannot be created during CUDA graph capture; run at least "
                "one step eagerly (with every param that will have a grad) before capturing."
            )
