"""Whether a model's last forward ran inside DistributedDataParallel.no_sync().

DDP decides in its forward whether the coming backward all-reduces the grads, so amp records it
from inside that forward: DDP calls the wrapped model there, and names itself the active DDP
module while it does. One Python call per forward of the model, nothing per op.
"""

from __future__ import annotations

from typing import Any

import torch


def _active_ddp() -> torch.nn.parallel.DistributedDataParallel | None:
    ddp_class = torch.nn.parallel.DistributedDataParallel
    getter = getattr(ddp_class, "_get_active_ddp_module", None)  # torch's own hook for dynamo
    return getter() if getter is not None else None


class NoSyncWatch:
    """A forward pre-hook on `model` that keeps `unsynced` up to date: True when the last
    forward ran under DDP's no_sync(), so its grads stay local to this rank."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.unsynced = False
        self._handle = model.register_forward_pre_hook(self._look)

    def _look(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        ddp = _active_ddp()
        self.unsynced = ddp is not None and not getattr(ddp, "require_backward_grad_sync", True)

    def remove(self) -> None:
        self._handle.remove()
