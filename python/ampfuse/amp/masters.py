"""fp32 master weights that follow the model they shadow.

amp keeps an fp32 master for every low-precision model param at O2 (in the fused optimizer's
state, or as a separate param swapped into a torch.optim optimizer). The master is the value the
optimizer updates, and each step writes it back, rounded, into the model. If anything else writes
the model's weights in between (``model.load_state_dict`` after ``amp.initialize``, which is the
usual resume order, a ``p.copy_`` under ``no_grad``, or a ``p.data = ...``), the master is stale,
and the next step would write the old weights back. apex made its masters lazily at the first
step, which hid this; we keep them from the start (they carry the exact fp32 values a checkpoint
restores) and so must notice when the model moves under them.

How a change is noticed, with no device sync on the training path: a param's version counter
and data pointer are recorded after every write amp or the optimizer makes; any other write
bumps the counter (or replaces the storage). Only when one differs is a value compared: a model
param that still holds exactly its master rounded to the low dtype keeps the master (the master
carries bits the model cannot), otherwise the master is remade from the model.

``model.load_state_dict`` is handled more exactly: a pre-hook picks up the incoming tensors, so
a checkpoint holding fp32 weights gives the masters those fp32 values, not their rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampfuse.optimizers._masters import param_mark, refresh_master  # noqa: F401


class MasterTracker:
    """Remembers, per model param, the version and storage of its last trusted write."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, int]] = {}  # id(model param) -> (version, data_ptr)

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Records the current state of `params` as written by amp or the optimizer."""
        marks = self._marks
        for p in params:
            marks[id(p)] = param_mark(p)

    def changed(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The params written by someone else since they were last marked."""
        marks = self._marks
        return [p for p in params if marks.get(id(p)) != param_mark(p)]

    def forget(self) -> None:
        self._marks.clear()


class LoadCapture:
    """Hooks on a model's load_state_dict that hand the tensors loaded into the params whose
    ids `mastered()` returns to `on_loaded(list of (param, loaded tensor))` once the load is
    done."""

    def __init__(self, model: torch.nn.Module, mastered: Callable[[], set[int]],
                 on_loaded: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]) -> None:
        self._mastered = mastered
        self._on_loaded = on_loaded
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [
            model.register_load_state_dict_pre_hook(self._before),
            model.register_load_state_dict_post_hook(self._after),
        ]

    def _before(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                *args: Any) -> None:
        mastered = self._mastered()  # once per load: a set, not a scan per param
        for name, param in module.named_parameters():
            value = state_dict.get(prefix + name)
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and id(param) in mastered):
                self._pending.append((param, value.detach()))

    def _after(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._on_loaded(pending)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
