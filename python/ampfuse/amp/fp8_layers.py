"""amp.initialize(..., fp8=True | an ampfuse.fp8 recipe): O2 with FP8 GEMMs.

fp8=True means ampfuse.fp8.CurrentScaling(). After the O2 cast, ampfuse.fp8.convert picks the
nn.Linear layers worth FP8 (the automatic size rule, or fp8_module_filter / fp8_min_features /
fp8_include / fp8_exclude) and turns them into ampfuse.fp8.Linear in place (same module object
and Parameters, so the optimizers, masters and hooks amp set up stay valid); the rest of O2 is
unchanged. verbosity >= 1 prints each Linear's decision and its reason. Under delayed scaling
the scales of all FP8 tensors are updated once per step, in a step pre-hook on the first
optimizer: after the step's backward passes, with the step's overflow flag, so a step amp skips
leaves the FP8 state as it was (only the step's amaxes are dropped).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ampfuse import fp8 as fp8_api

if TYPE_CHECKING:
    from ampfuse.amp.binding import Binding


def resolve(fp8: bool | fp8_api.Recipe | None, opt_level: str,
            device: torch.device) -> fp8_api.Recipe | None:
    """The recipe asked for (None for fp8=False/None); refuses what cannot work."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        recipe: fp8_api.Recipe = fp8_api.CurrentScaling()
    elif isinstance(fp8, (fp8_api.CurrentScaling, fp8_api.RowwiseScaling,
                          fp8_api.DelayedScaling)):
        recipe = fp8
    else:
        raise TypeError(f"amp.initialize: fp8 must be True, False or a recipe: "
                        f"ampfuse.fp8.CurrentScaling, ampfuse.fp8.RowwiseScaling or "
                        f"ampfuse.fp8.DelayedScaling; got {fp8!r}.")
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


def check_filter_options(fp8: object, **options: object) -> None:
    """The fp8_* filter options mean nothing without fp8: refuse them rather than ignore."""
    given = [name for name, value in options.items() if value is not None]
    if given and (fp8 is None or fp8 is False):
        raise ValueError(f"amp.initialize: {', '.join(given)} choose which Linears run in FP8, "
                         "but fp8 is off; pass fp8=True (or a recipe) too, or drop them.")


def convert_linears(models: Iterable[torch.nn.Module], recipe: fp8_api.Recipe, verbosity: int,
                    module_filter: Callable[[str, torch.nn.Module], bool] | None = None,
                    min_features: int | None = None, include: Collection[str] | None = None,
                    exclude: Collection[str] | None = None) -> dict[str, str]:
    """ampfuse.fp8.convert on every model (names prefixed "model{i}." when there are several);
    prints the decisions at verbosity >= 1 (on rank 0); returns them."""
    models = list(models)
    if len(models) > 1:  # (with one model, convert checks the names itself)
        linears = {f"model{i}.{fqn}" for i, model in enumerate(models)
                   for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for option, given in (("fp8_include", include), ("fp8_exclude", exclude)):
            unknown = sorted(n for n in (given or ()) if n not in linears)
            if unknown and not isinstance(given, str):
                raise ValueError(f"amp.initialize: {option} names {unknown}, which are no "
                                 f"nn.Linear of the models; their Linears are "
                                 f"{sorted(linears)}.")
    decisions: dict[str, str] = {}
    for i, model in enumerate(models):
        # With several models, names carry a "model{i}." prefix, in the decisions and in
        # fp8_include / fp8_exclude alike.
        prefix = f"model{i}." if len(models) > 1 else ""
        made = fp8_api.convert(model, recipe, module_filter=module_filter,
                               min_features=min_features, include=_own(include, prefix, model),
                               exclude=_own(exclude, prefix, model))
        decisions.update((prefix + fqn, d) for fqn, d in made.items())
    dist = torch.distributed
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if verbosity >= 1 and rank0:  # every rank decides alike: one printout
        fp8_count = sum(d.startswith("fp8") for d in decisions.values())
        print(f"amp fp8 ({type(recipe).__name__}): {fp8_count} of {len(decisions)} Linear "
              "layers compute in FP8")
        for fqn, decision in decisions.items():
            print(f"amp fp8:   {fqn or '<model>'}: {decision}")
    if not any(d.startswith("fp8") for d in decisions.values()):
        warnings.warn(
            "amp.initialize: fp8 is on, but no Linear layer was converted (their GEMMs are too "
            "small to gain from FP8, or their sizes are not multiples of 16), so the model "
            "trains as plain O2. verbosity=1 prints why per layer; fp8_min_features or "
            "fp8_include force layers into FP8.", stacklevel=3)
    return decisions


def _own(names: Collection[str] | None, prefix: str,
         model: torch.nn.Module) -> list[str] | None:
    """The names of `model`'s Linears among `names`, without the model's prefix."""
    if names is None or isinstance(names, str):
        return names  # type: ignore[return-value]  # (convert refuses a bare string)
    linears = {fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    own = [n[len(prefix):] for n in names if isinstance(n, str) and n.startswith(prefix)]
    return [n for n in own if n in linears] if prefix else list(names)


class ScaleUpdates:
    """The step pre-hook that updates every FP8 scale once per optimizer step."""

    def __init__(self, models: Iterable[torch.nn.Module], binding: Binding) -> None:
        self.models = list(models)
        self.binding = binding
        self.hook = binding.inner.register_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        fp8_api.update_scales(self.models, found_inf=self._found_inf(optimizer))

    @staticmethod
    def needed(models: Iterable[torch.nn.Module]) -> bool:
        """Only delayed scaling has scales to update."""
        return any(isinstance(m.fp8_recipe, fp8_api.DelayedScaling)
                   for m in fp8_api.fp8_modules(list(models)))

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        flag = getattr(optimizer, "found_inf", None)  # set by amp for fused optimizers
        if isinstance(flag, torch.Tensor):
            return flag
        if getattr(self.binding, "skip_step", False):  # torch.optim: decided on the host
            return torch.ones(1, device=self.binding.device)
        return None

    def remove(self) -> None:
        self.hook.remove()
