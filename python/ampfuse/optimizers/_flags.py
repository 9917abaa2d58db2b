"""Validation of the boolean options the fused optimizers keep in their param groups."""

from __future__ import annotations


def check_flag(optimizer, index, group, key):
    """A group option that is a switch must be True or False: 1, "yes" or None would silently
    pick a behaviour the caller may not have meant."""
    value = group[key]
    if not isinstance(value, bool):
        raise ValueError(
            f"{type(optimizer).__name__}: param_groups[{index}] has {key}={value!r}; it must be "
            "True or False."
        )
