"""apex's function registries: register_half_function(module, name) and its float and promote
twins, which put a torch function on O1's lists for models initialized afterwards, and the
@half_function / @float_function / @promote_function decorators for the user's own functions.
"""

from __future__ import annotations

import torch

from ampfuse.amp import aten_lists, casting

# Registrations made with register_*_function before initialize, as in apex. Each initialize
# copies them into its own handle, so later registrations never change an initialized model.
pending_lists: dict[str, set[str]] = {"low": set(), "fp32": set(), "promote": set()}


def _register(kind: str, module: object, name: str) -> None:
    if not hasattr(module, name):
        raise AttributeError(f"amp.register_{kind}_function: {module!r} has no attribute {name!r}.")
    target = getattr(module, name)
    overridable = torch.overrides.get_overridable_functions()
    if not any(target in funcs for funcs in overridable.values()):
        raise ValueError(
            f"amp.register_{kind}_function: {getattr(module, '__name__', module)}.{name} is not "
            "a torch function, and ampfuse casts without replacing functions. Decorate your own "
            f"function with @amp.{kind}_function instead."
        )
    aten_lists.check_entry(name, f"amp.register_{kind}_function")
    pending_lists[{"half": "low", "float": "fp32", "promote": "promote"}[kind]].add(name)


def register_half_function(module: object, name: str) -> None:
    """Under O1, runs torch function module.name in the low dtype for models initialized after."""
    _register("half", module, name)


def register_float_function(module: object, name: str) -> None:
    """Under O1, runs torch function module.name in fp32 for models initialized after."""
    _register("float", module, name)


def register_promote_function(module: object, name: str) -> None:
    """Under O1, casts module.name's inputs to the widest of their dtypes."""
    _register("promote", module, name)


half_function = casting.cast_decorator("half")
float_function = casting.cast_decorator("float")
promote_function = casting.cast_decorator("promote")
