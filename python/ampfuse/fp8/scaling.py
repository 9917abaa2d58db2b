"""One delayed-scaling update for every FP8 tensor of a model, per optimizer step; and
``invalidate``, which drops cached FP8 weights after a write no optimizer step covers."""

from __future__ import annotations

from collections import defaultdict

import torch

from ampfuse.fp8.linear import Linear
from ampfuse.fp8.recipe import DelayedScaling
from ampfuse.fp8.weight_cache import invalidate_all
from ampfuse.ops import fp8 as fp8_ops


def fp8_modules(
    models: torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...]
) -> list[Linear]:
    """Every ampfuse.fp8.Linear in `models` (a module or a list), each once."""
    models = models if isinstance(models, (list, tuple)) else [models]
    seen: set[int] = set()
    found: list[Linear] = []
    for model in models:
        for m in model.modules():
            if isinstance(m, Linear) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found


def update_scales(models: torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...],
                  found_inf: torch.Tensor | None = None) -> None:
    """Moves every FP8 tensor's amax history one step and sets its next scale, on the device:
    one ``fp8_update_scales_`` call per (device, margin, amax_compute), so usually one.

    Call it once per optimizer step, after the step's backward passes (amp.initialize with
    fp8 does, in an optimizer step pre-hook). ``found_inf``: this step's overflow flag; when
    it is set the step's amaxes are dropped and the scales stay. Layers of the other recipes
    have nothing to update and are passed over."""
    invalidate_all()  # the weights' cached FP8 copies were cast with the old scales
    groups: defaultdict[tuple[torch.device, int, str], list[Linear]] = defaultdict(list)
    for m in fp8_modules(models):
        r = m.fp8_recipe
        if not isinstance(r, DelayedScaling):
            continue  # current and rowwise scaling keep no history
        groups[(m.fp8_input_amax.device, r.margin, r.amax_compute)].append(m)
    for (device, margin, amax_compute), mods in groups.items():
        lists = {kind: [t for m in mods for t in m.fp8_state(kind)]
                 for kind in ("amax", "amax_history", "scale", "scale_inv")}
        # A flag on another device (a CPU flag with CUDA states, say) is copied over, in stream
        # order: dropping it would let an overflowed step's amaxes into the history.
        flag = found_inf.to(device) if found_inf is not None else None
        fp8_ops.fp8_update_scales_(
            lists["amax"], lists["amax_history"], lists["scale"], lists["scale_inv"],
            [v for m in mods for v in m.fp8_maxes()], margin, amax_compute, flag)


def invalidate(models: torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...]
               ) -> None:
    """Drops the cached FP8 weights of every ampfuse.fp8.Linear in `models`. Needed only after
    writing a weight through ``.data`` (which bypasses its version counter) when no optimizer
    step follows before the next forward; every other write is seen on its own."""
    for m in fp8_modules(models):
        m.invalidate()
