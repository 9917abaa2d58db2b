"""ampfuse.fp8.convert: which nn.Linear layers of a model compute in FP8, and why.

An FP8 Linear pays for casting its input and output gradient (memory-bound passes) and gains
only in its GEMMs, so small GEMMs run slower in FP8 than in bf16. ``convert`` therefore
decides per layer, in this order (the first rule that speaks decides):

1. ``exclude`` (fully qualified names): stays high precision.
2. ``include``: FP8 (an included layer that cannot be FP8 is an error).
3. ``module_filter(fqn, module) -> bool``: replaces the rules below.
4. ``min_features``: FP8 when in_features and out_features are both >= it.
5. the automatic rule: both >= AUTO_MIN_FEATURES.

Whatever the rule, a layer must be exactly ``torch.nn.Linear`` (a subclass may change its
forward) with in_features and out_features multiples of 16 (cuBLASLt's FP8 layout rule).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from ampfuse.fp8.linear import ALIGN, Linear
from ampfuse.fp8.recipe import Recipe, checked_recipe

# The automatic rule: a Linear goes FP8 when in_features (the GEMM's K) and out_features (N)
# are both at least this. PROVISIONAL, until benchmarks/bench_fp8_threshold.py measures the
# break-even on an H100 and this value is replaced by its data. Source of the provisional
# value: torchao's float8 README (torchao/float8/README.md, "Performance"), which estimates the
# forward-shape speedup of a float8 Linear over bf16 on an H100 (tensorwise dynamic scaling,
# forward + backward, torch.compile): M,K,N = 1024,2048,1024 runs at 0.80x ("leave this linear
# in bfloat16"), M,K,N = 4096,8192,16384 at 1.39x. For a Linear M is the number of tokens,
# K = in_features, N = out_features; M is unknown when converting, so the rule looks at K and N
# only, and 4096 sits between the losing and the winning example. GPT-2 small's Linears
# (768 and 3072 features) stay in bf16/fp16; a Llama-8B-sized layer (4096 x 14336) goes FP8.
AUTO_MIN_FEATURES = 4096

ModuleFilter = Callable[[str, torch.nn.Module], bool]


def _names(option: str, value: Collection[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"ampfuse.fp8.convert: {option} must be a list or set of fully "
                        f"qualified module names (e.g. [\"layers.0.mlp.fc1\"]), got {value!r}.")
    return frozenset(value)


def _check_options(module_filter: ModuleFilter | None, min_features: int | None) -> None:
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"ampfuse.fp8.convert: module_filter must be a callable(fqn, module) "
                        f"-> bool, got {module_filter!r}.")
    if min_features is not None and (isinstance(min_features, bool)
                                     or not isinstance(min_features, int) or min_features < 0):
        raise ValueError(f"ampfuse.fp8.convert: min_features must be an int >= 0, got "
                         f"{min_features!r}.")
    if module_filter is not None and min_features is not None:
        raise ValueError("ampfuse.fp8.convert: pass module_filter or min_features, not both: "
                         "module_filter replaces the size rules, so min_features would be "
                         "ignored. Test the sizes inside module_filter.")


def _ineligible(module: torch.nn.Linear) -> str | None:
    """Why `module` cannot run in FP8, or None."""
    if type(module) is not torch.nn.Linear:
        return (f"a subclass of nn.Linear ({type(module).__qualname__}) whose forward may "
                "differ; not converted")
    bad = [f"{n}={v}" for n, v in (("in_features", module.in_features),
                                   ("out_features", module.out_features)) if v % ALIGN]
    if bad:
        return f"{', '.join(bad)} not a multiple of {ALIGN} (cuBLASLt's FP8 rule)"
    return None


def _decide(fqn: str, module: torch.nn.Linear, include: frozenset[str],
            exclude: frozenset[str], module_filter: ModuleFilter | None,
            min_features: int | None) -> tuple[bool, str]:
    """(goes FP8, the reason) for one nn.Linear."""
    if fqn in exclude:
        return False, "in exclude"
    why_not = _ineligible(module)
    if fqn in include:
        if why_not is not None:
            raise ValueError(f"ampfuse.fp8.convert: include names {fqn!r}, which cannot run in "
                             f"FP8: {why_not}. Remove it from include.")
        return True, "in include"
    if why_not is not None:
        return False, why_not
    shape = f"{module.in_features} -> {module.out_features}"
    if module_filter is not None:
        if module_filter(fqn, module):
            return True, "module_filter returned True"
        return False, "module_filter returned False"
    limit, rule = ((min_features, "min_features") if min_features is not None
                   else (AUTO_MIN_FEATURES, "automatic rule, AUTO_MIN_FEATURES"))
    if module.in_features >= limit and module.out_features >= limit:
        return True, f"{shape}: both features >= {limit} ({rule})"
    return False, (f"{shape}: GEMM too small to gain from FP8, needs both features >= {limit} "
                   f"({rule})")


def convert(model: torch.nn.Module, recipe: Recipe | None = None, *,
            module_filter: ModuleFilter | None = None, min_features: int | None = None,
            include: Collection[str] | None = None, exclude: Collection[str] | None = None,
            ) -> dict[str, str]:
    """Converts the chosen nn.Linear layers of `model` to ampfuse.fp8.Linear in place (same
    module objects and Parameters) and returns ``{fqn: decision}`` for every nn.Linear, each
    decision "fp8: <reason>" or "kept: <reason>" (see the module docstring for the rules).

    recipe: CurrentScaling() (the default), RowwiseScaling() or DelayedScaling(). Names in
    include/exclude must name nn.Linear layers of `model` (a typo is an error)."""
    recipe = checked_recipe(recipe, "ampfuse.fp8.convert")
    include_set, exclude_set = _names("include", include), _names("exclude", exclude)
    _check_options(module_filter, min_features)
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted((include_set | exclude_set) - set(linears))
    if unknown:
        raise ValueError(f"ampfuse.fp8.convert: {unknown} name no nn.Linear of the model; its "
                         f"Linears are {sorted(linears)}.")
    decisions: dict[str, str] = {}
    chosen: list[torch.nn.Linear] = []
    for fqn, module in linears.items():
        if isinstance(module, Linear):
            decisions[fqn] = f"fp8: already an ampfuse.fp8.Linear ({module.fp8_recipe!r})"
            continue
        to_fp8, reason = _decide(fqn, module, include_set, exclude_set, module_filter,
                                 min_features)
        decisions[fqn] = f"{'fp8' if to_fp8 else 'kept'}: {reason}"
        if to_fp8:
            chosen.append(module)
    # Every decision made (and every error raised) before the first layer changes.
    for module in chosen:
        Linear.from_linear(module, recipe)
    return decisions
