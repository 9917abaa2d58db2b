"""amp.initialize(..., fp8=True | ampfuse.fp8.DelayedScaling(...)): O2 with FP8 GEMMs.

After the O2 cast, every plain nn.Linear whose in_features and out_features are multiples of
16 becomes an ampfuse.fp8.Linear in place (same module object and Parameters, so the
optimizers, masters and hooks amp set up stay valid); the rest of O2 is unchanged. The scales
of all FP8 tensors are updated once per step, in a step pre-hook on the first optimizer: after
the step's backward passes, with the step's overflow flag, so a step amp skips leaves the FP8
state as it was (only the step's amaxes are dropped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ampfuse import fp8 as fp8_api

if TYPE_CHECKING:
    from ampfuse.amp.binding import Binding


def resolve(fp8: bool | fp8_api.DelayedScaling | None, opt_level: str,
            device: torch.device) -> fp8_api.DelayedScaling | None:
    """The recipe asked for (None for fp8=False/None); refuses what cannot work."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        recipe = fp8_api.DelayedScaling()
    elif isinstance(fp8, fp8_api.DelayedScaling):
        recipe = fp8
    else:
        raise TypeError(f"amp.initialize: fp8 must be True, False or an "
                        f"ampfuse.fp8.DelayedScaling, got {fp8!r}.")
    if opt_level != "O2":
        raise ValueError(
            f"amp.initialize: fp8 is an O2 option, got opt_level={opt_level!r}. FP8 GEMMs need "
            "the fp32 master weights and low-precision model of O2 (O0 is fp32, O1 casts per "
            "op, O3 has no masters): use opt_level='O2', fp8=...")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise RuntimeError(
                f"amp.initialize: fp8 needs a GPU of compute capability 8.9 or newer (Ada, "
                f"Hopper, Blackwell) for its FP8 GEMMs; {torch.cuda.get_device_name(device)} "
                f"is {capability[0]}.{capability[1]}. Leave fp8 off on this GPU.")
    return recipe


def eligible(module: torch.nn.Module) -> bool:
    return (type(module) is torch.nn.Linear and module.in_features % fp8_api.linear.ALIGN == 0
            and module.out_features % fp8_api.linear.ALIGN == 0)


def swap_linears(models: Iterable[torch.nn.Module], recipe: fp8_api.DelayedScaling) -> list[str]:
    """Converts the eligible nn.Linear layers of `models` in place; returns their names."""
    swapped = []
    for model in models:
        for name, module in model.named_modules():
            if eligible(module):
                fp8_api.Linear.from_linear(module, recipe)
                swapped.append(name)
    if not swapped:
        raise ValueError(
            "amp.initialize: fp8 was asked for, but the models have no nn.Linear whose "
            "in_features and out_features are both multiples of 16 (cuBLASLt's FP8 rule), so "
            "nothing would run in FP8. Leave fp8 off, or give the layers such sizes.")
    return swapped


class ScaleUpdates:
    """The step pre-hook that updates every FP8 scale once per optimizer step."""

    def __init__(self, models: Iterable[torch.nn.Module], binding: Binding) -> None:
        self.models = list(models)
        self.binding = binding
        self.hook = binding.inner.register_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        fp8_api.update_scales(self.models, found_inf=self._found_inf(optimizer))

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        flag = getattr(optimizer, "found_inf", None)  # set by amp for fused optimizers
        if isinstance(flag, torch.Tensor):
            return flag
        if getattr(self.binding, "skip_step", False):  # torch.optim: decided on the host
            return torch.ones(1, device=self.binding.device)
        return None

    def remove(self) -> None:
        self.hook.remove()
