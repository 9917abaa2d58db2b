"""The FP8 copies of a weight, made once per optimizer step and reused until the weight changes.

Under gradient accumulation every micro-batch multiplies by the same weight, so its FP8 copies
(both layouts and their scales) are made by the first forward after a change and reused by the
next ones. A cached copy is dropped when anything may have written the weight:

- any optimizer step anywhere in the process (torch.optim.Optimizer's global step hooks fire
  for torch's optimizers and for ampfuse's, which derive from it; ampfuse's fused kernels write
  params without bumping their version counter, so the version alone would miss them);
- an in-place write through autograd's view of the weight (``p.copy_``, ``p.mul_``: the
  version counter) or a new storage (``p.data = ...``, ``module.to``: the data pointer);
- ``load_state_dict`` and ``module._apply`` (``.to``, ``.cuda``, ``.half``) on the layer;
- ``ampfuse.fp8.update_scales`` (delayed scaling's scales move) and ``invalidate``.

A layer that is itself an FSDP2 ``fully_shard`` unit caches nothing: its weight is
all-gathered for each forward, and keeping the whole layer's FP8 copies between micro-batches
would undo the sharding's memory saving. While torch.compile traces, nothing is cached: the
compiled graph quantizes the weight in each forward (a graph cannot keep Python state between
calls). The one write the cache cannot
see is one through ``p.data`` (``p.data.copy_(...)``), which by design bypasses the version
counter: call ``ampfuse.fp8.invalidate(model)`` after such a write if no optimizer step
follows it before the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# Bumped by every optimizer step (before and after it) and by invalidate_all: a cached copy
# made under another generation is stale.
_generation = 0


def invalidate_all() -> None:
    """Drops every cached FP8 weight in the process (their next forward re-quantizes)."""
    global _generation
    _generation += 1


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
    invalidate_all()


# Pre and post: amp writes the low-precision model params from the masters in a post hook.
register_optimizer_step_pre_hook(_on_optimizer_step)
register_optimizer_step_post_hook(_on_optimizer_step)


def _key(weight: torch.Tensor, extra: object) -> tuple[object, ...] | None:
    try:
        version = weight._version
    except RuntimeError:  # an inference-mode tensor has no version counter: never cached
        return None
    return (_generation, version, weight.data_ptr(), weight.dtype, weight.device,
            tuple(weight.shape), extra)


class WeightCache:
    """One layer's cached FP8 weight: ``get(weight, make)`` returns ``make(weight)``, from the
    cache while the weight is unchanged (see the module docstring for what counts)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._key: tuple[object, ...] | None = None
        self._value: Any = None

    def get(self, weight: torch.Tensor, make: Callable[[torch.Tensor], Any],
            extra: object = None) -> Any:
        """`extra`: anything else the copy depends on (compared with ==)."""
        if not self.enabled or torch.compiler.is_compiling():
            return make(weight)
        key = _key(weight, extra)
        if key is None:
            return make(weight)
        if key != self._key:
            self._value = None  # free the old copies before making the new ones
            self._value = make(weight)
            self._key = key
        return self._value

    def invalidate(self) -> None:
        self._key = None
        self._value = None

    # A copied or pickled layer (copy.deepcopy, torch.save of the module) starts empty: the
    # copies belong to the original's weight.
    def __getstate__(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "_key": None, "_value": None}

    @property
    def holds(self) -> bool:
        """Whether a copy is cached (it may still be stale: get() checks)."""
        return self._value is not None
