"""Loss scaling: ``GradScaler`` (a drop-in for ``torch.amp.GradScaler``), the ``LossScaler``
state behind it and behind ``amp``, gradient unscaling with overflow attribution, and the
multi-device global gradient norm.

This package sits above ``ampfuse.ops`` and ``ampfuse.overflow`` and below the optimizers and
amp: it steps optimizers only through ``torch.optim.Optimizer``'s interface.
"""

from ampfuse.scaling.grad_scaler import GradScaler
from ampfuse.scaling.loss_scaler import LossScaler

__all__ = ["GradScaler", "LossScaler"]
